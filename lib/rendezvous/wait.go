package rendezvous

import (
	"context"
	"strconv"
	"time"
)

// await polls the store until every key exists and returns their values.
// owners[i] is the member expected to write keys[i], named when time runs
// out.
func (s *Session) await(ctx context.Context, keys []string, owners []int, what string) ([][]byte, error) {
	vals := make([][]byte, len(keys))
	missing := make([]int, len(keys))
	for i := range missing {
		missing[i] = i
	}
	backoff := time.Millisecond
	for {
		var err error
		still := missing[:0]
		for _, i := range missing {
			if err != nil {
				still = append(still, i)
				continue
			}
			v, ok, e := s.cfg.Store.TryGet(ctx, s.key(keys[i]))
			switch {
			case e != nil:
				err = e
				still = append(still, i)
			case ok:
				vals[i] = v
			default:
				still = append(still, i)
			}
		}
		missing = still
		if len(missing) == 0 {
			return vals, nil
		}
		if err == nil {
			t := time.NewTimer(backoff)
			select {
			case <-ctx.Done():
				err = ctx.Err()
			case <-t.C:
			}
			t.Stop()
			backoff = min(2*backoff, 50*time.Millisecond)
		}
		if err != nil {
			who := make([]int, len(missing))
			for k, i := range missing {
				who[k] = owners[i]
			}
			return nil, s.Explain(ctx, err, what, who...)
		}
	}
}

// Barrier marks this member ready and waits for every other member.
func (s *Session) Barrier(ctx context.Context) error {
	if err := s.cfg.Store.Set(ctx, s.key(keyReady+strconv.Itoa(s.cfg.Self)), []byte("1")); err != nil {
		return s.Explain(ctx, err, "mark this member ready")
	}
	var keys []string
	var owners []int
	for i := range s.cfg.Members {
		if i != s.cfg.Self {
			keys = append(keys, keyReady+strconv.Itoa(i))
			owners = append(owners, i)
		}
	}
	_, err := s.await(ctx, keys, owners, "finish connecting")
	return err
}
