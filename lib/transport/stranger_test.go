package transport

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/store/storetest"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/wire"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// What a stranger who can reach a member's bridge port can do to the
// setup: nothing that keeps the members' own connections out.

// endpointAddr reads member i's bridge address from the store, as a
// stranger finds the port (a port scan finds it as well).
func endpointAddr(t *testing.T, b *bridge, i int) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	v, err := dialStore(t, b.addr, b.ns).Prefix("bridge").Get(ctx, "endpoint/"+strconv.Itoa(i))
	require.NoError(t, err)
	var ep tcpEndpoint
	require.NoError(t, json.Unmarshal(v, &ep))
	return net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port))
}

// secretOf reads the job's secret from the store (a stranger on the store's
// network can; the job tag it derives is also visible on the wire).
func secretOf(t *testing.T, b *bridge) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	v, err := dialStore(t, b.addr, b.ns).Prefix("bridge").Get(ctx, "secret")
	require.NoError(t, err)
	return v
}

// logLine is one line of a JSON slog handler.
type logLine struct {
	Level      string `json:"level"`
	Msg        string `json:"msg"`
	From       string `json:"from"`
	Err        string `json:"err"`
	Suppressed int    `json:"suppressed"`
}

func parseLogs(t *testing.T, s string) []logLine {
	t.Helper()
	var out []logLine
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		var l logLine
		require.NoError(t, json.Unmarshal(sc.Bytes(), &l), "log line %q", sc.Text())
		out = append(out, l)
	}
	return out
}

// stranger connects to target again and again until ctx ends: each time
// it runs talk on the connection, and after the member closes it waits a
// little and connects again.
func stranger(ctx context.Context, target string, talk func(ctx context.Context, c net.Conn)) {
	for ctx.Err() == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", target)
		if err == nil {
			stop := context.AfterFunc(ctx, func() { _ = c.Close() })
			talk(ctx, c)
			stop()
			_ = c.Close()
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// idle says nothing and waits for the member to close the connection.
func idle(_ context.Context, c net.Conn) { _, _ = io.Copy(io.Discard, c) }

// drip sends msg one byte every 100 ms, over and over.
func drip(msg []byte) func(context.Context, net.Conn) {
	return func(ctx context.Context, c net.Conn) {
		for i := 0; ctx.Err() == nil; i++ {
			if _, err := c.Write(msg[i%len(msg) : i%len(msg)+1]); err != nil {
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
}

// tagged sends a hello with this job's tag (seen on the wire), reads the
// challenge, and never proves anything.
func tagged(tag [jobTagSize]byte) func(context.Context, net.Conn) {
	return func(_ context.Context, c net.Conn) {
		hello := hsMsg{Version: wire.ProtocolVersion, Type: hsHello, Job: tag, From: 1, To: 0, Stream: 0, Streams: 2}
		if writeHS(c, &hello) != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c)
	}
}

// Issue 9, defect 3: 64 idle connections to member 0's bridge port used to
// fill its pending-handshake limit, and member 1's connections were closed
// at once ("read challenge: EOF"), failing the setup on both members.
// Here strangers keep connecting all through the setup: idle ones (more
// than the limit), ones that send garbage or a hello of another job a byte
// at a time, and ones that send a hello with this job's tag and then never
// the proof. The members connect anyway, and the strangers cost a few
// rate-limited warnings, never an error.
func TestStrangersCannotStarveSetup(t *testing.T) {
	b := newBridge(t, "tcp", 2, 2, false)
	logs := &storetest.SyncBuffer{}
	b.cfgs[0].Log = slog.New(slog.NewJSONHandler(logs, nil))
	b.cfgs[1].Log = slog.New(slog.NewJSONHandler(logs, nil))
	b.set(func(c *Config) { c.Timeout = testenv.Scale(30 * time.Second) })
	join := b.twoStep(t)
	target := endpointAddr(t, b, 0)
	tag := jobTag(secretOf(t, b))
	other := jobTag([]byte("another job's secret"))

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range maxPendingHS + 36 {
		wg.Go(func() { stranger(ctx, target, idle) })
	}
	for range 8 {
		wg.Go(func() { stranger(ctx, target, drip([]byte("GET / HTTP/1.1\r\nHost: gpubridge\r\n\r\n"))) })
		wrong := appendHS(nil, &hsMsg{Version: wire.ProtocolVersion, Type: hsHello, Job: other, From: 1, Streams: 2})
		wg.Go(func() { stranger(ctx, target, drip(wrong)) })
		wg.Go(func() { stranger(ctx, target, tagged(tag)) })
	}
	// The strangers fill member 0's pending handshakes before member 1
	// dials.
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "too many handshakes in progress") },
		testenv.Scale(20*time.Second), 10*time.Millisecond, "the strangers never filled the listener")

	meshes := join() // past the strangers
	cancel()
	wg.Wait()
	exchange(t, meshes, []int{5, 1 << 20})

	warns := 0
	for _, l := range parseLogs(t, logs.String()) {
		assert.NotEqual(t, "ERROR", l.Level, "a stranger is no member: %+v", l)
		if l.Level == "WARN" {
			warns++
			assert.NotEmpty(t, l.From, "a warning about a connection names its remote address: %+v", l)
		}
	}
	// Hundreds of connections, a handful of lines: every kind of refusal
	// is rate-limited.
	assert.LessOrEqual(t, warns, 4*logBurst+4, "warnings: %d", warns)
}

// Issue 9: a stranger's wrong-version hello was logged at ERROR as if a
// member spoke it. The job tag is checked first: a hello of another job is
// a warning about the remote address, whatever its version; a hello with
// this job's tag in another version is an error about that member.
func TestStrangerHelloLogged(t *testing.T) {
	b := newBridge(t, "tcp", 2, 1, false)
	logs := &storetest.SyncBuffer{}
	b.cfgs[0].Log = slog.New(slog.NewJSONHandler(logs, nil))
	join := b.twoStep(t)
	target := endpointAddr(t, b, 0)
	tag := jobTag(secretOf(t, b))

	// send sends a hello and returns the member's answer (a reject) and
	// the stranger's local address, which the member sees as "from".
	send := func(hello hsMsg) (hsMsg, string) {
		c, err := net.Dial("tcp", target)
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, c.SetDeadline(time.Now().Add(testenv.Scale(10*time.Second))))
		require.NoError(t, writeHS(c, &hello))
		m, err := readHS(c)
		require.NoError(t, err)
		return m, c.LocalAddr().String()
	}
	v2 := uint16(wire.ProtocolVersion + 1)
	rep, _ := send(hsMsg{Version: v2, Type: hsHello, Job: jobTag([]byte("not this job")), From: 1, Streams: 1})
	assert.Equal(t, "wrong job: this is a bridge member of another job", rep.Text)
	rep, memberAddr := send(hsMsg{Version: v2, Type: hsHello, Job: tag, From: 1, Streams: 1})
	assert.Equal(t, fmt.Sprintf("this gbbridge speaks bridge protocol v%d", wire.ProtocolVersion), rep.Text)
	// Many more strangers: the warnings stop at the burst.
	for range 3 * logBurst {
		send(hsMsg{Version: v2, Type: hsHello, Job: jobTag([]byte("not this job")), From: 1, Streams: 1})
	}

	var lines []logLine
	require.Eventually(t, func() bool {
		lines = parseLogs(t, logs.String())
		n := 0
		for _, l := range lines {
			if l.From != "" {
				n++
			}
		}
		return n >= 1+logBurst
	}, testenv.Scale(10*time.Second), 10*time.Millisecond, "logs: %s", logs.String())
	// Which strangers' lines got through the limiter depends on the order
	// the member's goroutines log in; every one that did is a warning.
	strangers := 0
	var member *logLine
	for i, l := range lines {
		switch l.From {
		case "":
		case memberAddr:
			member = &lines[i]
		default:
			strangers++
			assert.Equal(t, "WARN", l.Level, "a stranger: %+v", l)
			assert.Contains(t, l.Msg, "no hello of this job")
			assert.Equal(t, "hello for another job (a stale member of an earlier job, or a stranger)", l.Err,
				"a stranger's version is not a member's")
		}
	}
	require.NotNil(t, member, "logs: %s", logs.String())
	assert.Equal(t, "ERROR", member.Level, "this job's tag in another version: %+v", member)
	assert.Equal(t, fmt.Sprintf("member 1 speaks bridge protocol v%d, this gbbridge speaks v%d", v2, wire.ProtocolVersion), member.Err)
	assert.Equal(t, logBurst, strangers, "stranger warnings are rate-limited: %s", logs.String())

	// The real member still joins.
	require.Len(t, join(), 2)
}

// A dialer whose connection is closed before the listener took it (a
// listener shedding connections: before the challenge, or after the
// proof) dials again within the setup deadline; one refused for a reason
// (here: another job) does not.
func TestDialRetriesUnansweredConnections(t *testing.T) {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	served := make(chan error, 1)
	accepted := 0
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				served <- err
				return
			}
			accepted++
			if accepted <= 2 {
				// Shed it, as a crowded listener does: closed unanswered.
				_ = c.Close()
				continue
			}
			_ = c.SetDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
			if accepted == 3 {
				// Shed after the proof: closed instead of welcomed.
				_, _, _ = serverHandshake(c, testParams(0), serverHooks{claim: func(int, int) error {
					_ = c.Close()
					return errors.New("shed")
				}})
				continue
			}
			_, _, err = serverHandshake(c, testParams(0), serverHooks{})
			served <- err
			if err != nil {
				_ = c.Close()
			}
			return
		}
	}()
	s := &setup{cfg: Config{Timeout: time.Minute}, log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithTimeout(context.Background(), testenv.Scale(20*time.Second))
	defer cancel()
	var notes []error
	conn, err := s.dial(ctx, net.IPv4(127, 0, 0, 1), tcpEndpoint{IP: "127.0.0.1", Port: port}, testParams(1), 0, 0,
		func(err error) { notes = append(notes, err) })
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, <-served)
	assert.Equal(t, 4, accepted)
	require.Len(t, notes, 3)
	for _, err := range notes {
		var ue *unansweredError
		assert.ErrorAs(t, err, &ue)
	}
	assert.ErrorContains(t, notes[2], "read welcome: ")

	// Refused for a reason: no retry.
	ln2, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer ln2.Close()
	count := make(chan int, 1)
	go func() {
		n := 0
		defer func() { count <- n }()
		for {
			c, err := ln2.Accept()
			if err != nil {
				return
			}
			n++
			_ = c.SetDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
			p := testParams(0)
			p.job[0] ^= 1
			_, _, _ = serverHandshake(c, p, serverHooks{})
			_ = c.Close()
		}
	}()
	_, err = s.dial(ctx, net.IPv4(127, 0, 0, 1), tcpEndpoint{IP: "127.0.0.1", Port: ln2.Addr().(*net.TCPAddr).Port}, testParams(1), 0, 0, func(error) {})
	require.ErrorContains(t, err, "member 0 refused the connection: wrong job")
	_ = ln2.Close()
	assert.Equal(t, 1, <-count)
}

func TestPendingSetEvicts(t *testing.T) {
	t0 := time.Unix(1000, 0)
	type conn struct {
		stage int
		age   int // seconds before t0
	}
	cases := []struct {
		name   string
		conns  []conn
		victim int // index into conns; -1: none (room left); -2: refused
	}{
		{"room", []conn{{stageHello, 5}, {stageHello, 9}}, -1},
		{"oldest idle first", []conn{{stageHello, 5}, {stageHello, 9}, {stageHello, 7}}, 1},
		{"idle before tagged", []conn{{stageTagged, 9}, {stageHello, 1}, {stageAuthed, 20}}, 1},
		{"oldest tagged when none is idle", []conn{{stageTagged, 3}, {stageAuthed, 20}, {stageTagged, 4}}, 2},
		{"authenticated never", []conn{{stageAuthed, 3}, {stageAuthed, 20}, {stageAuthed, 4}}, -2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ps := newPendingSet(3)
			var pcs []*pendingConn
			var closers []io.Closer
			for _, c := range tc.conns {
				a, z := tcpPair(t)
				closers = append(closers, a, z)
				pc := &pendingConn{conn: a, since: t0.Add(-time.Duration(c.age) * time.Second), stage: c.stage}
				pcs = append(pcs, pc)
				_, ok := ps.admit(pc)
				require.True(t, ok)
			}
			a, z := tcpPair(t)
			closers = append(closers, a, z)
			victim, ok := ps.admit(&pendingConn{conn: a, since: t0})
			switch tc.victim {
			case -1:
				assert.True(t, ok)
				assert.Nil(t, victim)
			case -2:
				assert.False(t, ok, "refused: only authenticated connections hold the slots")
			default:
				require.True(t, ok)
				require.Same(t, pcs[tc.victim], victim)
				_, evicted := victim.state()
				assert.True(t, evicted)
				// Its handshake fails at once.
				_, err := victim.conn.Read(make([]byte, 1))
				assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
			}
			for _, c := range closers {
				_ = c.Close()
			}
		})
	}
}

// tcpPair returns two connected TCP connections on loopback.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer ln.Close()
	a, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	require.NoError(t, err)
	z, err := ln.AcceptTCP()
	require.NoError(t, err)
	return a, z
}

func TestLogLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLogLimiter()
	l.now = func() time.Time { return now }
	for i := range logBurst {
		ok, n := l.allow("a")
		require.True(t, ok, "line %d of the burst", i)
		require.Zero(t, n)
	}
	for range 7 {
		ok, _ := l.allow("a")
		require.False(t, ok)
	}
	ok, _ := l.allow("b")
	assert.True(t, ok, "kinds are limited apart")
	now = now.Add(logEvery)
	ok, n := l.allow("a")
	assert.True(t, ok)
	assert.Equal(t, 7, n, "the next line says how many were held back")
	ok, _ = l.allow("a")
	assert.False(t, ok)
}
