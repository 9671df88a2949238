package rendezvous

import (
	"context"
	"crypto/rand"
	"fmt"
)

// secretSize is the length of the job's secret.
const secretSize = 32

// join makes (member 0) or reads the job's secret.
func (s *Session) join(ctx context.Context) error {
	var v []byte
	if s.cfg.Self == 0 {
		b := make([]byte, secretSize)
		if _, err := rand.Read(b); err != nil {
			return err
		}
		// CompareSet keeps the first secret when member 0 runs again.
		cur, err := s.cfg.Store.CompareSet(ctx, s.key(keySecret), nil, b)
		if err != nil {
			return s.Explain(ctx, err, "make the bridge secret")
		}
		v = cur
	} else {
		vals, err := s.await(ctx, []string{keySecret}, []int{0}, "publish the bridge secret")
		if err != nil {
			return err
		}
		v = vals[0]
	}
	if len(v) != secretSize {
		return fmt.Errorf("the bridge secret in the store has %d bytes, want %d", len(v), secretSize)
	}
	s.secret = v
	return nil
}
