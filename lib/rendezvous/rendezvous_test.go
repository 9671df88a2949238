package rendezvous

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// memStore is a Store in memory with torch's compare-and-set semantics.
type memStore struct {
	mu sync.Mutex
	kv map[string][]byte
}

func newMemStore() *memStore { return &memStore{kv: map[string][]byte{}} }

func (m *memStore) Set(_ context.Context, key string, value []byte) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.kv[key] = bytes.Clone(value)
	return nil
}

func (m *memStore) TryGet(_ context.Context, key string) ([]byte, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.kv[key]
	return bytes.Clone(v), ok, nil
}

func (m *memStore) CompareSet(_ context.Context, key string, expected, desired []byte) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	cur, ok := m.kv[key]
	switch {
	case !ok && len(expected) == 0, ok && bytes.Equal(cur, expected):
		m.kv[key] = bytes.Clone(desired)
		return bytes.Clone(desired), nil
	case !ok:
		return bytes.Clone(expected), nil
	}
	return bytes.Clone(cur), nil
}

// rec is a record as a transport makes one.
type rec struct {
	Proto int `json:"proto"`
	Identity
	Addr string `json:"addr,omitempty"`
}

func configs(st Store, n int, timeout time.Duration) []Config {
	ms := make([]Member, n)
	for i := range ms {
		ms[i] = Member{Rank: 2 * i, Host: fmt.Sprintf("host-%c", 'a'+i)}
	}
	cfgs := make([]Config, n)
	for i := range cfgs {
		cfgs[i] = Config{Store: st, Scope: "bridge", Self: i, Members: ms, Timeout: timeout}
	}
	return cfgs
}

// runAll runs the given members' Run at once, each under a context with
// its config's timeout, and returns their errors by member.
func runAll(cfgs []Config, connect func(ctx context.Context, s *Session) error, which ...int) []error {
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for _, i := range which {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), cfgs[i].Timeout)
			defer cancel()
			errs[i] = Run(ctx, cfgs[i], connect)
		})
	}
	wg.Wait()
	return errs
}

func TestSecretIsKept(t *testing.T) {
	st := newMemStore()
	cfgs := configs(st, 2, testenv.Scale(10*time.Second))
	var secrets [][]byte
	var mu sync.Mutex
	keep := func(_ context.Context, s *Session) error {
		mu.Lock()
		defer mu.Unlock()
		secrets = append(secrets, s.Secret())
		return nil
	}
	for _, who := range [][]int{{0}, {0}, {1}} {
		require.NoError(t, runAll(cfgs, keep, who...)[who[0]])
	}
	require.Len(t, secrets, 3)
	assert.Len(t, secrets[0], secretSize)
	assert.Equal(t, secrets[0], secrets[1], "a restarted member 0 keeps the job's secret")
	assert.Equal(t, secrets[0], secrets[2])
	assert.Contains(t, st.kv, "bridge/secret")
}

func TestGather(t *testing.T) {
	cfgs := configs(newMemStore(), 3, testenv.Scale(10*time.Second))
	got := make([][]rec, 3)
	errs := runAll(cfgs, func(ctx context.Context, s *Session) error {
		if err := s.Publish(ctx, rec{Proto: 1, Identity: s.Identity(), Addr: fmt.Sprint("addr-", s.Self())}); err != nil {
			return err
		}
		recs, err := Gather[rec](ctx, s, nil)
		if err != nil {
			return err
		}
		got[s.Self()] = recs
		return s.Barrier(ctx)
	}, 0, 1, 2)
	for i, err := range errs {
		require.NoError(t, err, "member %d", i)
	}
	for i := range got {
		require.Len(t, got[i], 3)
		for j, r := range got[i] {
			assert.Equal(t, fmt.Sprint("addr-", j), r.Addr)
			assert.Equal(t, Identity{Member: j, Rank: 2 * j, Hostname: fmt.Sprintf("host-%c", 'a'+j), PID: r.PID}, r.Identity)
		}
	}
}

// The records refused, and how: the same error on every member where
// every member reads the same thing.
func TestGatherRefuses(t *testing.T) {
	tests := []struct {
		name   string
		forge  func(s *Session, st *memStore) // run by member 1 instead of publishing
		agree  func([]rec) error
		want   string
		shared bool
	}{
		{"settings differ", nil, func(recs []rec) error {
			if recs[0].Proto != recs[1].Proto {
				return fmt.Errorf("protocol: v%d, v%d", recs[0].Proto, recs[1].Proto)
			}
			return nil
		}, "protocol: v1, v2", true},
		{"unsigned", func(s *Session, st *memStore) {
			b, _ := json.Marshal(rec{Proto: 2, Identity: s.Identity()})
			st.kv["bridge/endpoint/1"] = b
		}, nil, "the endpoint record of member 1 (rank 2 on host-b) is not signed with this job's secret", true},
		{"signed with another secret", func(s *Session, st *memStore) {
			b, _ := json.Marshal(rec{Proto: 2, Identity: s.Identity()})
			other := &Session{secret: bytes.Repeat([]byte{7}, secretSize)}
			st.kv["bridge/endpoint/1"] = other.sign(b)
		}, nil, "is not signed with this job's secret (written by a stranger, or a member of another job)", true},
		{"changed after signing", func(s *Session, st *memStore) {
			b, _ := json.Marshal(rec{Proto: 2, Identity: s.Identity()})
			st.kv["bridge/endpoint/1"] = bytes.Replace(s.sign(b), []byte(`"proto":2`), []byte(`"proto":3`), 1)
		}, nil, "is not signed with this job's secret", true},
		{"another member's identity", func(s *Session, st *memStore) {
			id := s.Identity()
			id.Member, id.Rank = 0, 0
			b, _ := json.Marshal(rec{Proto: 2, Identity: id})
			st.kv["bridge/endpoint/1"] = s.sign(b)
		}, nil, "the endpoint record of member 1 (rank 2 on host-b) says member 0, rank 0 on host-b: the members have different topologies", false},
		{"not JSON", func(_ *Session, st *memStore) { st.kv["bridge/endpoint/1"] = []byte("{") }, nil,
			"member 1 (rank 2 on host-b) published a bad endpoint record: not JSON: ", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := newMemStore()
			cfgs := configs(st, 2, testenv.Scale(10*time.Second))
			errs := runAll(cfgs, func(ctx context.Context, s *Session) error {
				if s.Self() == 1 && tt.forge != nil {
					st.mu.Lock()
					tt.forge(s, st)
					st.mu.Unlock()
				} else if err := s.Publish(ctx, rec{Proto: 1 + s.Self(), Identity: s.Identity()}); err != nil {
					return err
				}
				_, err := Gather(ctx, s, tt.agree)
				return err
			}, 0, 1)
			for i, err := range errs {
				require.Error(t, err, "member %d", i)
				assert.ErrorContains(t, err, tt.want, "member %d", i)
				var se *SharedError
				assert.Equal(t, tt.shared, errors.As(err, &se), "member %d: %v", i, err)
			}
			if tt.shared {
				assert.Equal(t, errs[0].Error(), errs[1].Error(), "the same error on every member")
			}
		})
	}
}

// A member that fails makes the others fail at once with its reason.
func TestFailurePropagates(t *testing.T) {
	cfgs := configs(newMemStore(), 3, testenv.Scale(30*time.Second))
	start := time.Now()
	errs := runAll(cfgs, func(ctx context.Context, s *Session) error {
		if s.Self() == 2 {
			return errors.New("no such interface")
		}
		_, err := Gather[rec](ctx, s, nil)
		return err
	}, 0, 1, 2)
	assert.Less(t, time.Since(start), cfgs[0].Timeout/2, "at once, not at the timeout")
	assert.EqualError(t, errs[2], "no such interface")
	for _, err := range errs[:2] {
		var re *RemoteError
		require.ErrorAs(t, err, &re)
		assert.EqualError(t, err, "member 2 (rank 4 on host-c) failed: no such interface")
		assert.NotErrorIs(t, err, context.DeadlineExceeded)
	}
}

func TestTimeoutNamesMissing(t *testing.T) {
	t.Run("record", func(t *testing.T) {
		cfgs := configs(newMemStore(), 3, testenv.Scale(500*time.Millisecond))
		errs := runAll(cfgs, func(ctx context.Context, s *Session) error {
			if err := s.Publish(ctx, rec{Identity: s.Identity()}); err != nil {
				return err
			}
			_, err := Gather[rec](ctx, s, nil)
			return err
		}, 0, 1)
		for i, err := range errs[:2] {
			require.Error(t, err, "member %d", i)
			assert.Contains(t, err.Error(), fmt.Sprintf("member 2 (rank 4 on host-c) did not publish its endpoint within %v", cfgs[0].Timeout))
			assert.ErrorIs(t, err, context.DeadlineExceeded, "member %d: a timeout, read or found", i)
		}
	})
	t.Run("secret", func(t *testing.T) {
		cfgs := configs(newMemStore(), 2, testenv.Scale(300*time.Millisecond))
		err := runAll(cfgs, func(context.Context, *Session) error { return nil }, 1)[1]
		assert.ErrorContains(t, err, fmt.Sprintf("member 0 (rank 0 on host-a) did not publish the bridge secret within %v", cfgs[1].Timeout))
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	})
	t.Run("barrier", func(t *testing.T) {
		cfgs := configs(newMemStore(), 2, testenv.Scale(300*time.Millisecond))
		err := runAll(cfgs, func(ctx context.Context, s *Session) error { return s.Barrier(ctx) }, 0)[0]
		assert.ErrorContains(t, err, "member 1 (rank 2 on host-b) did not finish connecting within")
	})
}

// The signature is the one gbbridge always wrote: the record's JSON with
// "mac" last, over the JSON without it, so members of builds before and
// after this package read each other's records.
func TestSignatureFormat(t *testing.T) {
	type old struct {
		Proto    int    `json:"proto"`
		Member   int    `json:"member"`
		Rank     int    `json:"rank"`
		Hostname string `json:"hostname"`
		PID      int    `json:"pid"`
		Addr     string `json:"addr,omitempty"`
		MAC      string `json:"mac,omitempty"`
	}
	secret := bytes.Repeat([]byte{1}, secretSize)
	o := old{Proto: 1, Member: 1, Rank: 2, Hostname: "host-b", PID: 99, Addr: "10.0.0.2"}
	body, _ := json.Marshal(o)
	h := hmac.New(sha256.New, secret)
	h.Write([]byte("endpoint\x00"))
	h.Write(body)
	o.MAC = hex.EncodeToString(h.Sum(nil))
	want, _ := json.Marshal(o)

	s := &Session{secret: secret}
	b, _ := json.Marshal(rec{Proto: 1, Identity: Identity{Member: 1, Rank: 2, Hostname: "host-b", PID: 99}, Addr: "10.0.0.2"})
	assert.Equal(t, string(want), string(s.sign(b)))
	assert.True(t, s.verify(want))
}

func TestDecode(t *testing.T) {
	tests := []struct {
		in, err string
	}{
		{`{"proto":1,"member":1,"addr":"x","mac":"ab"}`, ""},
		{`{"proto":"1"}`, "JSON, but not an endpoint record: "},
		{`[1,2,3]`, "JSON, but not an endpoint record: "},
		{`{"proto":1,`, "not JSON: "},
		{`{"addr":"` + strings.Repeat("x", maxRecordBytes) + `"}`, "over the 4096-byte limit"},
	}
	for _, tt := range tests {
		r, err := decode[rec]([]byte(tt.in))
		if tt.err != "" {
			assert.ErrorContains(t, err, tt.err, tt.in)
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, rec{Proto: 1, Identity: Identity{Member: 1}, Addr: "x"}, r)
	}
}

// FuzzRecord: whatever the store holds under a member's record key,
// decoding it and checking its signature never panics, what decodes
// re-encodes to a record that decodes the same, and a record verifies
// only as signed.
func FuzzRecord(f *testing.F) {
	s := &Session{secret: bytes.Repeat([]byte{3}, secretSize)}
	good, _ := json.Marshal(rec{Proto: 1, Identity: Identity{Member: 1, Rank: 2, Hostname: "host-b", PID: 1234}, Addr: "10.0.0.2:29501"})
	for _, seed := range []string{string(s.sign(good)), `{"proto":"1"}`, `[1,2,3]`, `{"proto":1,`, `null`, `{"mac":"` + strings.Repeat("ab", 32) + `"}`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		signed := s.verify(b)
		r, err := decode[rec](b)
		if err != nil {
			return
		}
		if len(b) > maxRecordBytes {
			t.Fatalf("accepted a record of %d bytes", len(b))
		}
		again, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if signed && !s.verify(s.sign(again)) {
			t.Fatalf("%s verified, but its re-encoding signed does not", b)
		}
		if len(again) > maxRecordBytes {
			return // zero fields and replaced invalid UTF-8 made it longer
		}
		r2, err := decode[rec](again)
		if err != nil || r2 != r {
			t.Fatalf("re-encoded %s decodes to %+v, %v", again, r2, err)
		}
	})
}

func TestPeerText(t *testing.T) {
	assert.Equal(t, "plain text", PeerText([]byte("plain text"), 100))
	assert.Equal(t, "a?b?c", PeerText([]byte("a\nb\x7fc"), 100))
	assert.Equal(t, "bad ? utf8", PeerText([]byte("bad \xff utf8"), 100))
	assert.Equal(t, "cut", PeerText([]byte("cut here"), 3))
}

// stillLive is a context whose deadline has passed while it does not say
// so yet: what a store call sees when its I/O deadline (the set-up's)
// fires before the context's own timer does, which a loaded machine makes
// likely.
type stillLive struct {
	context.Context
	dl time.Time
}

func (c stillLive) Deadline() (time.Time, bool) { return c.dl, true }

// A store call's own "i/o timeout" at the set-up deadline is reported as
// the set-up timeout naming the member waited for, never as the call's
// error (issue 9: TestMissingMember got "store tryget ...: i/o timeout"
// under load).
func TestExplainDeadlineBeforeContext(t *testing.T) {
	cfg := configs(newMemStore(), 3, 1500*time.Millisecond)[0]
	s := &Session{cfg: cfg}
	ctx := stillLive{Context: context.Background(), dl: time.Now().Add(-time.Millisecond)}
	require.NoError(t, ctx.Err(), "the context itself is not done")
	ioErr := errors.New("store tryget bridge/endpoint/2: read tcp 127.0.0.1:1->127.0.0.1:2: i/o timeout")

	err := s.Explain(ctx, ioErr, "publish its endpoint", 2)
	assert.EqualError(t, err, "member 2 (rank 4 on host-c) did not publish its endpoint within 1.5s: context deadline exceeded")
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	var se *SharedError
	assert.ErrorAs(t, err, &se, "worded the same on every member")

	// Before the deadline the call's own error is what happened.
	live := stillLive{Context: context.Background(), dl: time.Now().Add(time.Hour)}
	assert.EqualError(t, s.Explain(live, ioErr, "publish its endpoint", 2), "publish its endpoint: "+ioErr.Error())
}
