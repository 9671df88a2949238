package store

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

func le64(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }

func TestServerLimitsCloseOnlyThatConnection(t *testing.T) {
	opts := ServerOptions{MaxKeyLen: 16, MaxValueLen: 64, MaxKeysPerRequest: 4, MaxTotalBytes: 64 << 10}
	tests := []struct {
		name   string
		req    []byte
		reason string
	}{
		{"key too long", append(append([]byte{cmdSet}, le64(17)...), bytes.Repeat([]byte("k"), 17)...),
			"key of 17 bytes exceeds MaxKeyLen 16"},
		{"value too long", append(append([]byte{cmdSet}, append(le64(1), 'k')...), le64(65)...),
			"value of 65 bytes exceeds MaxValueLen 64"},
		{"huge announced value", append(append([]byte{cmdAppend}, append(le64(1), 'k')...), le64(1<<62)...),
			"value of 4611686018427387904 bytes exceeds MaxValueLen"},
		{"too many keys", append([]byte{cmdCheck}, le64(5)...), "CHECK with 5 keys exceeds MaxKeysPerRequest 4"},
		{"count overflow", append([]byte{cmdMultiSet}, le64(^uint64(0))...), "exceeds MaxKeysPerRequest"},
		{"unknown command", []byte{18}, "unknown command 18"},
		{"unknown command 0xff", []byte{0xff, 1, 2, 3}, "unknown command 255"},
		{"bad validate magic", []byte{cmdValidate, 1, 2, 3, 4}, "VALIDATE with bad magic"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := startServer(t, opts)
			good := dialT(t, ts.addr)
			ctx := tctx(t)
			require.NoError(t, good.Set(ctx, "k", []byte("before")))

			bad := rawDial(t, ts.addr, true)
			bad.send(tt.req)
			bad.closedByPeer()
			ts.waitLog(t, tt.reason)

			v, err := good.Get(ctx, "k")
			require.NoError(t, err)
			assert.Equal(t, "before", string(v))
			require.NoError(t, good.Set(ctx, "k2", []byte("after")))
		})
	}
}

func TestServerMemoryBudget(t *testing.T) {
	ts := startServer(t, ServerOptions{MaxTotalBytes: 4096, MaxValueLen: 8192})
	ctx := tctx(t)
	c := dialT(t, ts.addr)
	other := dialT(t, ts.addr)
	require.NoError(t, c.Set(ctx, "small", []byte("1")))
	// A value above the remaining budget: refused while decoding.
	err := c.Set(ctx, "big", make([]byte, 5000))
	if err == nil { // SET has no reply: the refusal shows on the next request
		err = c.Ping(ctx)
	}
	require.Error(t, err)
	ts.waitLog(t, "MaxTotalBytes")
	// Filling the store with many small values is refused the same way.
	var fillErr error
	for i := 0; i < 100 && fillErr == nil; i++ {
		fillErr = other.Set(ctx, fmt.Sprint("fill", i), make([]byte, 100))
		if fillErr == nil {
			fillErr = other.Ping(ctx)
		}
	}
	require.Error(t, fillErr)
	// Deleting makes room again; the connections reconnect.
	for i := range 100 {
		_, err := c.Delete(ctx, fmt.Sprint("fill", i))
		require.NoError(t, err)
	}
	require.NoError(t, c.Set(ctx, "again", make([]byte, 1000)))
	v, err := other.Get(ctx, "small")
	require.NoError(t, err)
	assert.Equal(t, "1", string(v))
	assert.LessOrEqual(t, ts.srv.mem.used.Load(), int64(4096))
}

func TestServerRefusesLegacyClients(t *testing.T) {
	tests := []struct {
		name  string
		first []byte
	}{
		// torch 1.13: SET 0 "init/" ... (no VALIDATE) and ADD 3, GET 2.
		{"1.13 SET", append(append([]byte{0}, le64(5)...), "init/"...)},
		{"1.13 ADD", append(append([]byte{3}, le64(5)...), "init/"...)},
		{"1.13 GET", append(append([]byte{2}, le64(4)...), "/foo"...)},
		{"http", []byte("GET / HTTP/1.1\r\n\r\n")},
		{"short then close", []byte{0, 0xce}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := startServer(t, ServerOptions{})
			r := rawDial(t, ts.addr, false)
			r.send(tt.first)
			if len(tt.first) < 5 {
				require.NoError(t, r.nc.(*net.TCPConn).CloseWrite())
			}
			r.closedByPeer()
			ts.waitLog(t, "gpubridge needs torch >= 2.8")
		})
	}
	t.Run("idle socket (1.13 watch-key socket)", func(t *testing.T) {
		ts := startServer(t, ServerOptions{HandshakeTimeout: 200 * time.Millisecond})
		r := rawDial(t, ts.addr, false)
		start := time.Now()
		r.closedByPeer()
		assert.Less(t, time.Since(start), testenv.Scale(3*time.Second))
		ts.waitLog(t, "gpubridge needs torch >= 2.8")
	})
}

func TestServerRawProtocol(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	r := rawDial(t, ts.addr, true)

	// GET of a missing key answers an empty value (libuv behaviour).
	r.req(&request{cmd: cmdGet, keys: []string{"/missing"}})
	assert.Empty(t, r.blob())
	// MULTI_GET of missing keys likewise.
	r.req(&request{cmd: cmdMultiGet, keys: []string{"/m1", "/m2"}})
	assert.Empty(t, r.blob())
	assert.Empty(t, r.blob())

	// Pipelined requests in one write, replies in order.
	var e enc
	encodeRequest(&e, &request{cmd: cmdSet, keys: []string{"/a"}, values: [][]byte{[]byte("1")}})
	encodeRequest(&e, &request{cmd: cmdAdd, keys: []string{"/a"}, delta: 41})
	encodeRequest(&e, &request{cmd: cmdPing, nonce: 7})
	encodeRequest(&e, &request{cmd: cmdCheck, keys: []string{"/a", "/b"}})
	encodeRequest(&e, &request{cmd: cmdGetNumKeys})
	encodeRequest(&e, &request{cmd: cmdDeleteKey, keys: []string{"/zz"}})
	encodeRequest(&e, &request{cmd: cmdListKeys})
	encodeRequest(&e, &request{cmd: cmdValidate, nonce: validationMagic}) // tolerated mid-stream
	encodeRequest(&e, &request{cmd: cmdGet, keys: []string{"/a"}})
	r.send(e.b)
	assert.EqualValues(t, 42, r.i64())
	assert.EqualValues(t, 7, r.u32())
	assert.Equal(t, checkNotReady, r.u8())
	assert.EqualValues(t, 1, r.i64())
	assert.EqualValues(t, 0, r.i64())
	assert.EqualValues(t, 1, r.i64())
	assert.Equal(t, "/a", string(r.blob()))
	assert.Equal(t, "42", string(r.blob()))

	// Fragmented reads: a request dribbled in one byte at a time.
	e = enc{}
	encodeRequest(&e, &request{cmd: cmdCompareSet, keys: []string{"/frag"}, values: [][]byte{nil, []byte("v")}})
	for _, b := range e.b {
		r.send([]byte{b})
		time.Sleep(time.Millisecond)
	}
	assert.Equal(t, "v", string(r.blob()))

	// A fragmented handshake.
	r2 := rawDial(t, ts.addr, false)
	for _, b := range []byte{cmdValidate, 0xce, 0xf7, 0x85, 0x3c, cmdPing, 1, 0, 0, 0} {
		r2.send([]byte{b})
		time.Sleep(time.Millisecond)
	}
	assert.EqualValues(t, 1, r2.u32())

	// CHECK and WAIT with zero keys are trivially ready.
	r.req(&request{cmd: cmdCheck})
	assert.Equal(t, checkReady, r.u8())
	r.req(&request{cmd: cmdWait})
	assert.Equal(t, waitStop, r.u8())

	// ADD overflow wraps like torch's int64.
	r.req(&request{cmd: cmdSet, keys: []string{"/max"}, values: [][]byte{[]byte("9223372036854775807")}})
	r.req(&request{cmd: cmdAdd, keys: []string{"/max"}, delta: 1})
	assert.EqualValues(t, int64(-9223372036854775808), r.i64())
}

func TestServerQueue(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	r := rawDial(t, ts.addr, true)
	r.req(&request{cmd: cmdQueueLen, keys: []string{"/q"}})
	assert.EqualValues(t, 0, r.i64())
	r.req(&request{cmd: cmdQueuePop, keys: []string{"/q"}})
	assert.EqualValues(t, 0, r.i64(), "empty pop answers length 0 and no item")
	for _, v := range []string{"a", "b", "c"} {
		r.req(&request{cmd: cmdQueuePush, keys: []string{"/q"}, values: [][]byte{[]byte(v)}})
	}
	r.req(&request{cmd: cmdQueueLen, keys: []string{"/q"}})
	assert.EqualValues(t, 3, r.i64())
	r.req(&request{cmd: cmdCheck, keys: []string{"/q"}})
	assert.Equal(t, checkReady, r.u8(), "non-empty queue counts as present")
	r.req(&request{cmd: cmdGetNumKeys})
	assert.EqualValues(t, 0, r.i64(), "queues are not keys")
	for i, v := range []string{"a", "b", "c"} {
		r.req(&request{cmd: cmdQueuePop, keys: []string{"/q"}})
		assert.EqualValues(t, 3-i, r.i64())
		assert.Equal(t, v, string(r.blob()))
	}

	// Two blocked poppers (WAIT on the queue): one push wakes exactly one.
	w1 := rawDial(t, ts.addr, true)
	w2 := rawDial(t, ts.addr, true)
	// Requests on a connection are handled in order: once the PING after a
	// WAIT is answered, the WAIT is registered. w1 registers first.
	w1.req(&request{cmd: cmdWait, keys: []string{"/q2"}})
	w1.req(&request{cmd: cmdPing, nonce: 1})
	assert.EqualValues(t, 1, w1.u32())
	w2.req(&request{cmd: cmdWait, keys: []string{"/q2"}})
	w2.req(&request{cmd: cmdPing, nonce: 2})
	assert.EqualValues(t, 2, w2.u32())
	r.req(&request{cmd: cmdQueuePush, keys: []string{"/q2"}, values: [][]byte{[]byte("x")}})
	assert.Equal(t, waitStop, w1.u8())
	w2.nothingWithin(100 * time.Millisecond)
	r.req(&request{cmd: cmdQueuePush, keys: []string{"/q2"}, values: [][]byte{[]byte("y")}})
	assert.Equal(t, waitStop, w2.u8())
}

func TestServerWait(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	setter := rawDial(t, ts.addr, true)
	wakers := []struct {
		name  string
		req   func(key string) *request
		reply func(r *raw) // reads the setter's reply
	}{
		{"SET", func(k string) *request { return &request{cmd: cmdSet, keys: []string{k}, values: [][]byte{nil}} }, nil},
		{"ADD", func(k string) *request { return &request{cmd: cmdAdd, keys: []string{k}, delta: 1} },
			func(r *raw) { assert.EqualValues(t, 1, r.i64()) }},
		{"APPEND", func(k string) *request {
			return &request{cmd: cmdAppend, keys: []string{k}, values: [][]byte{[]byte("x")}}
		}, nil},
		{"MULTI_SET", func(k string) *request {
			return &request{cmd: cmdMultiSet, keys: []string{"/other", k}, values: [][]byte{nil, nil}}
		}, nil},
		{"COMPARE_SET", func(k string) *request {
			return &request{cmd: cmdCompareSet, keys: []string{k}, values: [][]byte{nil, []byte("v")}}
		}, func(r *raw) { assert.Equal(t, "v", string(r.blob())) }},
	}
	for _, wk := range wakers {
		t.Run("woken by "+wk.name, func(t *testing.T) {
			w := rawDial(t, ts.addr, true)
			key := "/w-" + wk.name
			w.req(&request{cmd: cmdWait, keys: []string{key, "/present"}})
			setter.req(&request{cmd: cmdSet, keys: []string{"/present"}, values: [][]byte{nil}})
			w.nothingWithin(50 * time.Millisecond)
			// Other requests are answered while the WAIT is pending.
			w.req(&request{cmd: cmdPing, nonce: 9})
			assert.EqualValues(t, 9, w.u32())
			setter.req(wk.req(key))
			if wk.reply != nil {
				wk.reply(setter)
			}
			assert.Equal(t, waitStop, w.u8())
		})
	}
	t.Run("compare_set that stores nothing does not wake", func(t *testing.T) {
		w := rawDial(t, ts.addr, true)
		w.req(&request{cmd: cmdWait, keys: []string{"/cs-miss"}})
		setter.req(&request{cmd: cmdCompareSet, keys: []string{"/cs-miss"}, values: [][]byte{[]byte("x"), []byte("y")}})
		assert.Equal(t, "x", string(setter.blob()))
		w.nothingWithin(50 * time.Millisecond)
		w.req(&request{cmd: cmdCancelWait})
		assert.Equal(t, waitCanceled, w.u8())
	})
	t.Run("cancel", func(t *testing.T) {
		w := rawDial(t, ts.addr, true)
		w.req(&request{cmd: cmdWait, keys: []string{"/never"}})
		w.req(&request{cmd: cmdCancelWait})
		assert.Equal(t, waitCanceled, w.u8())
		// The canceled wait does not fire later.
		setter.req(&request{cmd: cmdSet, keys: []string{"/never"}, values: [][]byte{nil}})
		w.nothingWithin(50 * time.Millisecond)
		// CANCEL_WAIT without a WAIT is answered too.
		w.req(&request{cmd: cmdCancelWait})
		assert.Equal(t, waitCanceled, w.u8())
	})
	t.Run("late STOP_WAITING precedes WAIT_CANCELED", func(t *testing.T) {
		// Race a SET against CANCEL_WAIT many times: the reply sequence must
		// always be [CANCELED] or [STOP, CANCELED], as torch's client
		// expects.
		var stops int
		for i := range 200 {
			w := rawDial(t, ts.addr, true)
			key := fmt.Sprintf("/race%d", i)
			w.req(&request{cmd: cmdWait, keys: []string{key}})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				var e enc
				encodeRequest(&e, &request{cmd: cmdSet, keys: []string{key}, values: [][]byte{nil}})
				_, _ = setter.nc.Write(e.b)
			}()
			w.req(&request{cmd: cmdCancelWait})
			first := w.u8()
			if first == waitStop {
				stops++
				assert.Equal(t, waitCanceled, w.u8())
			} else {
				assert.Equal(t, waitCanceled, first)
			}
			wg.Wait()
			w.req(&request{cmd: cmdPing, nonce: 1})
			assert.EqualValues(t, 1, w.u32(), "no stray byte after the cancel")
			_ = w.nc.Close()
		}
		t.Logf("%d of 200 races saw a late STOP_WAITING", stops)
	})
	t.Run("waiter connection closes", func(t *testing.T) {
		w := rawDial(t, ts.addr, true)
		w.req(&request{cmd: cmdWait, keys: []string{"/gone"}})
		time.Sleep(10 * time.Millisecond)
		_ = w.nc.Close()
		time.Sleep(10 * time.Millisecond)
		setter.req(&request{cmd: cmdSet, keys: []string{"/gone"}, values: [][]byte{nil}})
		setter.req(&request{cmd: cmdPing, nonce: 3})
		assert.EqualValues(t, 3, setter.u32())
	})
}

func TestServerShutdownWithBlockedWaiters(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := NewServer(ServerOptions{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	addr := ln.Addr().String()
	require.Eventually(t, func() bool { return srv.Addr() != nil }, testenv.Scale(10*time.Second), time.Millisecond)
	assert.Equal(t, addr, srv.Addr().String())

	// Server-side waiters (torch style) and a polling Get.
	var waiters []*raw
	for range 3 {
		w := rawDial(t, addr, true)
		w.req(&request{cmd: cmdWait, keys: []string{"/never"}})
		waiters = append(waiters, w)
	}
	c := dialT(t, addr)
	getErr := make(chan error, 1)
	go func() {
		_, err := c.Get(context.Background(), "never")
		getErr <- err
	}()
	time.Sleep(50 * time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(10*time.Second))
	defer cancel()
	start := time.Now()
	require.NoError(t, srv.Shutdown(ctx))
	assert.Less(t, time.Since(start), testenv.Scale(2*time.Second))
	require.NoError(t, <-served)
	for _, w := range waiters {
		w.closedByPeer()
	}
	select {
	case err := <-getErr:
		require.Error(t, err)
	case <-time.After(testenv.Scale(10 * time.Second)):
		t.Fatal("Get still blocked after Shutdown")
	}
	// Serve after Shutdown returns at once.
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	require.NoError(t, srv.Serve(ln2))
}

func TestServerMaxConns(t *testing.T) {
	ts := startServer(t, ServerOptions{MaxConns: 2})
	c1 := dialT(t, ts.addr)
	c2 := dialT(t, ts.addr)
	r := rawDial(t, ts.addr, false)
	r.closedByPeer()
	ts.waitLog(t, "MaxConns reached")
	require.NoError(t, c1.Ping(tctx(t)))
	require.NoError(t, c2.Ping(tctx(t)))
}

func TestServerSlowReaderDoesNotBlockOthers(t *testing.T) {
	ts := startServer(t, ServerOptions{})
	c := dialT(t, ts.addr)
	ctx := tctx(t)
	big := bytes.Repeat([]byte("x"), 1<<20)
	require.NoError(t, c.Set(ctx, "big", big))
	// A client that pipelines GETs of 1 MiB and never reads.
	slow := rawDial(t, ts.addr, true)
	var e enc
	for range 64 {
		encodeRequest(&e, &request{cmd: cmdGet, keys: []string{"/big"}})
	}
	go func() { _, _ = slow.nc.Write(e.b) }()
	time.Sleep(100 * time.Millisecond)
	for i := range 20 {
		require.NoError(t, c.Set(ctx, fmt.Sprint("k", i), []byte("v")))
		_, err := c.Get(ctx, fmt.Sprint("k", i))
		require.NoError(t, err)
	}
	_ = slow.nc.Close()
}

func TestParseStoll(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true},
		{"42", 42, true},
		{"-7", -7, true},
		{"+7", 7, true},
		{"  12", 12, true},
		{"\t\n-3x", -3, true},
		{"12abc", 12, true},
		{"9223372036854775807", 9223372036854775807, true},
		{"-9223372036854775808", -9223372036854775808, true},
		{"9223372036854775808", 0, false},
		{"-9223372036854775809", 0, false},
		{"99999999999999999999999", 0, false},
		{"", 0, false},
		{"-", 0, false},
		{"abc", 0, false},
		{" + 1", 0, false},
	}
	for _, tt := range tests {
		t.Run(strings.ReplaceAll(tt.in, " ", "_"), func(t *testing.T) {
			got, ok := parseStoll([]byte(tt.in))
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.want, got)
		})
	}
}
