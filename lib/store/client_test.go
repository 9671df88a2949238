package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

func TestWireKey(t *testing.T) {
	tests := []struct {
		name     string
		prefixes []string
		key      string
		want     string
	}{
		{"plain", nil, "foo", "/foo"},
		{"empty key", nil, "", "/"},
		{"one prefix", []string{"default_pg"}, "0", "/default_pg/0"},
		{"chain, innermost store first", []string{"qq", "pp"}, "k", "/qq/pp/k"},
		{"empty prefix kept", []string{""}, "k", "//k"},
		{"torch 2.11 gloo key", []string{"default_pg", "0", "", "cpu", ""}, "rank_0", "/default_pg/0//cpu//rank_0"},
		{"slash in key", []string{"a"}, "b/c", "/a/b/c"},
		{"init key gets prefixed", nil, "init/", "/init/"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, WireKey(tt.prefixes, tt.key))
		})
	}
}

func TestClientServerOps(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx := tctx(t)

	steps := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"ping", func(t *testing.T) { require.NoError(t, c.Ping(ctx)) }},
		{"set+get", func(t *testing.T) {
			require.NoError(t, c.Set(ctx, "k", []byte("v")))
			v, err := c.Get(ctx, "k")
			require.NoError(t, err)
			assert.Equal(t, []byte("v"), v)
		}},
		{"set empty value", func(t *testing.T) {
			require.NoError(t, c.Set(ctx, "empty", nil))
			v, ok, err := c.TryGet(ctx, "empty")
			require.NoError(t, err)
			assert.True(t, ok)
			assert.Empty(t, v)
		}},
		{"large value", func(t *testing.T) {
			big := bytes.Repeat([]byte("0123456789abcdef"), 300_000) // 4.8 MB
			require.NoError(t, c.Set(ctx, "big", big))
			v, err := c.Get(ctx, "big")
			require.NoError(t, err)
			assert.True(t, bytes.Equal(big, v))
			ok, err := c.Delete(ctx, "big")
			require.NoError(t, err)
			assert.True(t, ok)
		}},
		{"tryget missing", func(t *testing.T) {
			v, ok, err := c.TryGet(ctx, "missing")
			require.NoError(t, err)
			assert.False(t, ok)
			assert.Nil(t, v)
		}},
		{"add", func(t *testing.T) {
			n, err := c.Add(ctx, "ctr", 3)
			require.NoError(t, err)
			assert.EqualValues(t, 3, n)
			n, err = c.Add(ctx, "ctr", -5)
			require.NoError(t, err)
			assert.EqualValues(t, -2, n)
			v, err := c.Get(ctx, "ctr")
			require.NoError(t, err)
			assert.Equal(t, "-2", string(v))
		}},
		{"add to value set as text", func(t *testing.T) {
			require.NoError(t, c.Set(ctx, "txt", []byte(" 40")))
			n, err := c.Add(ctx, "txt", 2)
			require.NoError(t, err)
			assert.EqualValues(t, 42, n)
		}},
		{"check", func(t *testing.T) {
			ok, err := c.Check(ctx, "k", "ctr")
			require.NoError(t, err)
			assert.True(t, ok)
			ok, err = c.Check(ctx, "k", "missing")
			require.NoError(t, err)
			assert.False(t, ok)
		}},
		{"append", func(t *testing.T) {
			require.NoError(t, c.Append(ctx, "ap", []byte("a")))
			require.NoError(t, c.Append(ctx, "ap", []byte("bc")))
			v, err := c.Get(ctx, "ap")
			require.NoError(t, err)
			assert.Equal(t, "abc", string(v))
		}},
		{"multi set+get", func(t *testing.T) {
			require.NoError(t, c.MultiSet(ctx, []string{"m1", "m2", "m3"}, [][]byte{[]byte("1"), nil, []byte("3")}))
			vs, err := c.MultiGet(ctx, []string{"m3", "m1", "m2"})
			require.NoError(t, err)
			assert.Equal(t, [][]byte{[]byte("3"), []byte("1"), {}}, vs)
			vs, err = c.MultiGet(ctx, nil)
			require.NoError(t, err)
			assert.Empty(t, vs)
			require.Error(t, c.MultiSet(ctx, []string{"a"}, nil))
		}},
		{"delete", func(t *testing.T) {
			ok, err := c.Delete(ctx, "m2")
			require.NoError(t, err)
			assert.True(t, ok)
			ok, err = c.Delete(ctx, "m2")
			require.NoError(t, err)
			assert.False(t, ok)
		}},
		{"num keys and list keys", func(t *testing.T) {
			n, err := c.NumKeys(ctx)
			require.NoError(t, err)
			keys, err := c.ListKeys(ctx)
			require.NoError(t, err)
			assert.Len(t, keys, int(n))
			assert.Equal(t, []string{"/ap", "/ctr", "/empty", "/k", "/m1", "/m3", "/txt"}, keys)
		}},
	}
	for _, s := range steps {
		t.Run(s.name, s.run)
	}
}

func TestClientCompareSet(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx := tctx(t)
	// Sequential cases on one key, as in torch's test_compare_set.
	tests := []struct {
		name              string
		expected, desired string
		want              string
		stored            string // "" = key missing
	}{
		{"missing key, non-empty expected: nothing stored, expected returned", "x", "y", "x", ""},
		{"missing key, empty expected: desired stored", "", "y", "y", "y"},
		{"match: swapped", "y", "z", "z", "z"},
		{"mismatch: current returned", "q", "w", "z", "z"},
		{"existing key, empty expected: no swap", "", "e", "z", "z"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.CompareSet(ctx, "cs", []byte(tt.expected), []byte(tt.desired))
			require.NoError(t, err)
			assert.Equal(t, tt.want, string(got))
			v, ok, err := c.TryGet(ctx, "cs")
			require.NoError(t, err)
			assert.Equal(t, tt.stored != "", ok)
			assert.Equal(t, tt.stored, string(v))
		})
	}
}

func TestClientBlockingTimeouts(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr, WithTimeout(300*time.Millisecond))
	tests := []struct {
		name    string
		ctxTO   time.Duration // 0: no ctx deadline, the client timeout applies
		run     func(ctx context.Context) error
		missing string
		max     time.Duration
	}{
		{"get, client timeout", 0, func(ctx context.Context) error { _, err := c.Get(ctx, "nope"); return err },
			`["nope"]`, 2 * time.Second},
		{"get, ctx deadline", 100 * time.Millisecond, func(ctx context.Context) error { _, err := c.Get(ctx, "nope"); return err },
			`["nope"]`, time.Second},
		{"wait names only missing keys", 0, func(ctx context.Context) error {
			return c.Wait(ctx, []string{"present", "gone1", "gone2"}, 200*time.Millisecond)
		}, `["gone1" "gone2"]`, 2 * time.Second},
		{"multi_get", 0, func(ctx context.Context) error {
			_, err := c.MultiGet(ctx, []string{"present", "gone3"})
			return err
		}, `["gone3"]`, 2 * time.Second},
	}
	require.NoError(t, c.Set(context.Background(), "present", []byte("1")))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			if tt.ctxTO > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.ctxTO)
				defer cancel()
			}
			start := time.Now()
			err := tt.run(ctx)
			require.ErrorIs(t, err, ErrTimeout)
			assert.Contains(t, err.Error(), tt.missing)
			assert.Less(t, time.Since(start), testenv.Scale(tt.max))
			if tt.ctxTO > 0 {
				assert.ErrorIs(t, err, context.DeadlineExceeded)
			}
		})
	}
	// The connection is still usable after timeouts.
	require.NoError(t, c.Ping(context.Background()))
}

func TestClientWaitWakesUp(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c1 := dialT(t, ts.addr)
	c2 := dialT(t, ts.addr)
	ctx := tctx(t)
	go func() {
		time.Sleep(50 * time.Millisecond)
		_ = c2.Set(ctx, "late", []byte("x"))
		_, _ = c2.Add(ctx, "later", 1)
	}()
	require.NoError(t, c1.Wait(ctx, []string{"late", "later"}, testenv.Scale(30*time.Second)))
	v, err := c1.Get(ctx, "later")
	require.NoError(t, err)
	assert.Equal(t, "1", string(v))
}

func TestClientCancel(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		time.Sleep(50 * time.Millisecond)
		cancel()
	}()
	start := time.Now()
	_, err := c.Get(ctx, "never")
	require.ErrorIs(t, err, context.Canceled)
	assert.NotErrorIs(t, err, ErrTimeout)
	assert.Less(t, time.Since(start), testenv.Scale(2*time.Second))
	require.NoError(t, c.Ping(context.Background()))
}

func TestClientConcurrent(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	ctx := tctx(t)
	const clients, goroutines, adds = 4, 4, 50
	var wg sync.WaitGroup
	errs := make(chan error, clients*goroutines)
	for i := range clients {
		c := dialT(t, ts.addr)
		for j := range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := range adds {
					if _, err := c.Add(ctx, "counter", 1); err != nil {
						errs <- err
						return
					}
					key := fmt.Sprintf("c%d/g%d/%d", i, j, k)
					if err := c.Set(ctx, key, []byte(key)); err != nil {
						errs <- err
						return
					}
					v, err := c.Get(ctx, key)
					if err != nil || string(v) != key {
						errs <- fmt.Errorf("get %s = %q, %v", key, v, err)
						return
					}
				}
			}()
		}
	}
	// A concurrent waiter on a key set last.
	waiter := dialT(t, ts.addr)
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := waiter.Wait(ctx, []string{"done"}, testenv.Scale(60*time.Second)); err != nil {
			errs <- err
		}
	}()
	time.Sleep(20 * time.Millisecond)
	c := dialT(t, ts.addr)
	require.NoError(t, c.Set(ctx, "done", nil))
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	v, err := c.Get(ctx, "counter")
	require.NoError(t, err)
	assert.Equal(t, fmt.Sprint(clients*goroutines*adds), string(v))
}

func TestClientPrefix(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx := tctx(t)
	a := c.Prefix("a")
	ab := a.Prefix("b")
	ae := a.Prefix("")
	require.NoError(t, ab.Set(ctx, "k", []byte("ab")))
	require.NoError(t, a.Set(ctx, "k", []byte("a")))
	require.NoError(t, ae.Set(ctx, "k", []byte("a-empty")))
	require.NoError(t, c.Set(ctx, "a/b/k", []byte("raw")))

	keys, err := c.ListKeys(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"/a//k", "/a/b/k", "/a/k"}, keys)

	// "/a/b/k" was overwritten by the unprefixed "a/b/k": same wire key.
	v, err := ab.Get(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, "raw", string(v))
	v, err = a.Get(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, "a", string(v))
	v, err = c.Prefix("a").Prefix("").Get(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, "a-empty", string(v))

	// Views do not affect each other and share the connection.
	_, ok, err := c.TryGet(ctx, "k")
	require.NoError(t, err)
	assert.False(t, ok)
	n, err := ab.Add(ctx, "n", 2)
	require.NoError(t, err)
	assert.EqualValues(t, 2, n)
	vs, err := ab.MultiGet(ctx, []string{"n", "k"})
	require.NoError(t, err)
	assert.Equal(t, [][]byte{[]byte("2"), []byte("raw")}, vs)
	ok, err = a.Check(ctx, "b/n")
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Contains(t, ab.String(), "a/b")
}

func TestClientClose(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx := tctx(t)
	done := make(chan error, 1)
	go func() {
		_, err := c.Get(ctx, "never")
		done <- err
	}()
	time.Sleep(30 * time.Millisecond)
	require.NoError(t, c.Close())
	require.NoError(t, c.Close())
	select {
	case err := <-done:
		require.ErrorIs(t, err, ErrClosed)
	case <-time.After(testenv.Scale(10 * time.Second)):
		t.Fatal("Get did not return after Close")
	}
	require.ErrorIs(t, c.Set(ctx, "k", nil), ErrClosed)
	require.ErrorIs(t, c.Prefix("p").Ping(ctx), ErrClosed)
	assert.Equal(t, ts.addr, c.Addr())
}

func TestDialRetriesAndTimesOut(t *testing.T) {
	// Reserve a port, close it: nothing listens there.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())

	start := time.Now()
	_, err = Dial(context.Background(), addr, WithConnectTimeout(300*time.Millisecond))
	require.ErrorIs(t, err, ErrTimeout)
	assert.Less(t, time.Since(start), testenv.Scale(3*time.Second))

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = Dial(ctx, addr)
	require.ErrorIs(t, err, ErrTimeout)

	// A server that appears later is found.
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr2 := ln2.Addr().String()
	require.NoError(t, ln2.Close())
	srv := NewServer(ServerOptions{})
	served := make(chan error, 1)
	go func() {
		time.Sleep(200 * time.Millisecond)
		served <- srv.ListenAndServe(addr2)
	}()
	c, err := Dial(context.Background(), addr2, WithConnectTimeout(testenv.Scale(20*time.Second)))
	require.NoError(t, err)
	require.NoError(t, c.Ping(context.Background()))
	require.NoError(t, c.Close())
	sctx, scancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
	defer scancel()
	require.NoError(t, srv.Shutdown(sctx))
	require.NoError(t, <-served)
}

func TestDialRefusesNonStoreServer(t *testing.T) {
	// A server that accepts and never answers the PING.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				_ = c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	_, err = Dial(context.Background(), ln.Addr().String(), WithConnectTimeout(300*time.Millisecond))
	require.ErrorIs(t, err, ErrTimeout)
	assert.Contains(t, err.Error(), "PING")
	require.NoError(t, ln.Close())
	wg.Wait()
}

func TestClientReconnectsAfterDroppedConnection(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx := tctx(t)
	require.NoError(t, c.Set(ctx, "text", []byte("abc")))
	// ADD on a non-numeric value: the server closes the connection.
	_, err := c.Add(ctx, "text", 1)
	require.Error(t, err)
	ts.waitLog(t, "is not an integer")
	// The next operation reconnects.
	v, err := c.Get(ctx, "text")
	require.NoError(t, err)
	assert.Equal(t, "abc", string(v))
}

func TestErrorsWrapContext(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	require.NoError(t, c.Close())
	ctx := tctx(t)
	_, err := c.Get(ctx, "kk")
	assert.ErrorContains(t, err, `store get "kk"`)
	_, err = c.Add(ctx, "kk", 1)
	assert.ErrorContains(t, err, `store add "kk"`)
	err = c.Wait(ctx, []string{"kk"}, time.Second)
	assert.ErrorContains(t, err, `store wait ["kk"]`)
	assert.True(t, errors.Is(err, ErrClosed))
}

// stallServer answers the handshake and then never replies.
func stallServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				hs := make([]byte, 10) // VALIDATE + magic, PING + nonce
				if _, err := io.ReadFull(c, hs); err != nil {
					return
				}
				_, _ = c.Write(hs[6:])
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

func TestClientIODeadline(t *testing.T) {
	addr := stallServer(t)
	tests := []struct {
		name string
		opts []Option
		ctx  time.Duration
		op   func(ctx context.Context, c *Client) error
	}{
		{"num_keys, ctx deadline", nil, 200 * time.Millisecond,
			func(ctx context.Context, c *Client) error { _, err := c.NumKeys(ctx); return err }},
		{"add, client timeout", []Option{WithTimeout(200 * time.Millisecond)}, 0,
			func(ctx context.Context, c *Client) error { _, err := c.Add(ctx, "k", 1); return err }},
		{"get, client timeout", []Option{WithTimeout(200 * time.Millisecond)}, 0,
			func(ctx context.Context, c *Client) error { _, err := c.Get(ctx, "k"); return err }},
		{"wait, ctx deadline", nil, 200 * time.Millisecond,
			func(ctx context.Context, c *Client) error { return c.Wait(ctx, []string{"k"}, time.Hour) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := dialT(t, addr, tt.opts...)
			ctx := context.Background()
			if tt.ctx > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tt.ctx)
				defer cancel()
			}
			start := time.Now()
			err := tt.op(ctx, c)
			require.Error(t, err)
			assert.Less(t, time.Since(start), testenv.Scale(2*time.Second))
			var ne net.Error
			if !errors.Is(err, ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
				require.ErrorAs(t, err, &ne)
				assert.True(t, ne.Timeout(), "%v", err)
			}
		})
	}
}
