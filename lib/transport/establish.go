package transport

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/wire"
)

// Config is what Establish needs to join a bridge.
type Config struct {
	// Store is the job's store client, already prefixed to the job
	// namespace; the bridge uses the keys under "bridge/" in it.
	Store *store.Client
	// Self is this member's index in Members.
	Self int
	// Members are every bridge member (island leader), in member order.
	Members []MemberInfo
	// Transport is "tcp" or "shm" (what discovery chose).
	Transport string
	// Streams is the number of data streams per pair of members (default 8).
	Streams int
	// CRC turns on a CRC32C of every frame's payload.
	CRC bool
	// Interface is the NIC to listen on and advertise (GPUBRIDGE_IFNAME);
	// "" is the interface that routes to the store's host.
	Interface string
	// ListenHost is an explicit IP (or host name) to bind and advertise; it
	// wins over Interface.
	ListenHost string
	// Timeout bounds the whole setup (default 60s).
	Timeout time.Duration
	// RingBytes is the size of each shm data ring (default 8 MiB, at least
	// 64 KiB, at most 1 GiB; control rings have 1 MiB). A frame of up to
	// half of it is handed to Recv's fn in place; larger frames are split
	// and reassembled (one more copy). 2 x the chunk size double-buffers.
	RingBytes int
	// Log receives setup events and refused connections (default: discard).
	Log *slog.Logger
	// Process names the program that runs Establish on every member (they
	// all run the same: "gbbridge serve"), for the messages that name a
	// peer's process: "gbbridge serve of rank 2 (pid 1234) died". Default:
	// this executable's name.
	Process string

	// proto overrides the protocol version this member speaks (tests).
	proto uint16
}

// MemberInfo is one bridge member as discovery describes it.
type MemberInfo struct {
	Rank int    // global rank
	Host string // hostname from discovery
}

// Defaults and limits of Config.
const (
	DefaultStreams   = 8
	DefaultTimeout   = 60 * time.Second
	DefaultRingBytes = 8 << 20
	MaxStreams       = 64
	minRingBytes     = 64 << 10
	maxRingBytes     = 1 << 30
)

// Errors a stream returns, wrapped in a *PeerError.
var (
	// ErrConnClosed: the peer's end of a connection went away without an
	// orderly close (EOF or reset). The error names the peer's process
	// and asks whether it died.
	ErrConnClosed = errors.New("connection closed")
	// ErrPeerClosed: the peer closed its mesh.
	ErrPeerClosed = errors.New("closed its end of the bridge")
	// ErrPeerDied: the peer's process is gone (shm); the error is a
	// *ProcessDiedError.
	ErrPeerDied = errors.New("process died")
)

// ProcessDiedError is a peer member's process found dead (shm: through its
// pidfd). The process is the bridge member's (gbbridge serve), not the
// rank's: the pid is the one the member published in its endpoint record.
type ProcessDiedError struct {
	Program string // Config.Process of the members: "gbbridge serve"
	Rank    int    // the global rank the process served
	PID     int
}

func (e *ProcessDiedError) Error() string {
	return fmt.Sprintf("%s of rank %d (pid %d) died", e.Program, e.Rank, e.PID)
}

// Is makes errors.Is(err, ErrPeerDied) true.
func (e *ProcessDiedError) Is(target error) bool { return target == ErrPeerDied }

// Store keys under "bridge/".
const (
	keySecret   = "secret"
	keyFailed   = "failed"
	keyEndpoint = "endpoint/"
	keyReady    = "ready/"
)

const (
	failPoll      = 100 * time.Millisecond // how often setup looks for another member's failure
	helloTimeout  = 2 * time.Second        // an accepted connection's hello must arrive within this
	hsTimeout     = 10 * time.Second       // bounds one connection handshake
	maxPendingHS  = 64                     // handshakes in progress on one listener beyond the members' own (admit.go)
	failWriteTime = 2 * time.Second
)

// endpoint is the record a member publishes under "endpoint/<member>".
type endpoint struct {
	Proto     int    `json:"proto"`
	Transport string `json:"transport"`
	Streams   int    `json:"streams"`
	CRC       bool   `json:"crc"`
	Member    int    `json:"member"`
	Rank      int    `json:"rank"`
	Hostname  string `json:"hostname"`
	PID       int    `json:"pid"`
	IP        string `json:"ip,omitempty"`
	Port      int    `json:"port,omitempty"`
	Interface string `json:"interface,omitempty"`
	SHM       string `json:"shm,omitempty"`
	PIDNS     string `json:"pidns,omitempty"`
	// MAC is HMAC-SHA256(secret, "endpoint" | this record's JSON with MAC
	// empty), hex.
	MAC string `json:"mac,omitempty"`
}

// maxEndpointBytes bounds an endpoint record read from the store (one has
// about 400 bytes).
const maxEndpointBytes = 4 << 10

// parseEndpoint decodes an endpoint record; its signature is checked
// apart.
func parseEndpoint(b []byte) (endpoint, error) {
	var e endpoint
	if len(b) > maxEndpointBytes {
		return e, fmt.Errorf("%d bytes, over the %d-byte limit", len(b), maxEndpointBytes)
	}
	if err := json.Unmarshal(b, &e); err != nil {
		if !json.Valid(b) {
			return endpoint{}, fmt.Errorf("not JSON: %w", err)
		}
		return endpoint{}, fmt.Errorf("JSON, but not an endpoint record: %w", err)
	}
	return e, nil
}

// maxFailureText bounds another member's failure message read from the
// store.
const maxFailureText = 4 << 10

// failTimeout starts a failure recorded in the store that was the set-up
// timeout, so that a member that reads it instead of noticing the timeout
// itself (they all run out at about the same instant) returns an error
// that is context.DeadlineExceeded too.
const failTimeout = "timeout\x00"

// remoteFailure is another member's setup failure, read from the store.
type remoteFailure struct {
	msg     string
	timeout bool // the failure was the set-up timeout
}

// newRemoteFailure makes the failure read from the store safe to show:
// at most maxFailureText bytes, printable.
func newRemoteFailure(v []byte) *remoteFailure {
	timeout := bytes.HasPrefix(v, []byte(failTimeout))
	v = bytes.TrimPrefix(v, []byte(failTimeout))
	if len(v) > maxFailureText {
		v = v[:maxFailureText]
	}
	return &remoteFailure{msg: printable(string(v)), timeout: timeout}
}

func (e *remoteFailure) Error() string { return e.msg }

// Unwrap makes a remote timeout errors.Is(err, context.DeadlineExceeded).
func (e *remoteFailure) Unwrap() error {
	if e.timeout {
		return context.DeadlineExceeded
	}
	return nil
}

// sharedError is a failure every member computes the same from what they
// all read (a settings disagreement, a member missing at the deadline). It
// is recorded without naming who noticed it, so that every member's error
// has the same text whether it found the failure itself or read it.
type sharedError struct{ err error }

func (e *sharedError) Error() string { return e.err.Error() }
func (e *sharedError) Unwrap() error { return e.err }

type setup struct {
	cfg    Config
	st     *store.Client
	log    *slog.Logger
	proto  uint16
	secret []byte
	job    [jobTagSize]byte
}

// Establish joins the bridge described by cfg: it shares the job's secret
// through the store, publishes this member's endpoint, checks that every
// member agrees on the settings, and connects to every other member with
// mutually authenticated connections (tcp) or shared-memory rings (shm).
// Any failure is written to the store, so that every member returns an
// error naming the cause within cfg.Timeout.
func Establish(ctx context.Context, cfg Config) (Mesh, error) {
	if err := cfg.normalize(); err != nil {
		return nil, fmt.Errorf("bridge setup: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	s := &setup{cfg: cfg, st: cfg.Store.Prefix("bridge"), log: cfg.Log, proto: cfg.proto}
	m, err := s.run(ctx)
	if err != nil {
		var rf *remoteFailure
		if !errors.As(err, &rf) {
			s.fail(ctx, err)
		}
		return nil, fmt.Errorf("bridge setup: %w", err)
	}
	s.log.Info("bridge established", "member", cfg.Self, "members", len(cfg.Members), "transport", m.Describe())
	return m, nil
}

func (c *Config) normalize() error {
	if c.Store == nil {
		return errors.New("no store")
	}
	if len(c.Members) < 2 {
		return fmt.Errorf("a bridge needs 2 or more members, got %d", len(c.Members))
	}
	if c.Self < 0 || c.Self >= len(c.Members) {
		return fmt.Errorf("member %d of %d", c.Self, len(c.Members))
	}
	if c.Streams == 0 {
		c.Streams = DefaultStreams
	}
	if c.Streams < 1 || c.Streams > MaxStreams {
		return fmt.Errorf("%d streams per peer (1..%d allowed)", c.Streams, MaxStreams)
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.RingBytes == 0 {
		c.RingBytes = DefaultRingBytes
	}
	if c.RingBytes < 0 || c.RingBytes > maxRingBytes {
		return fmt.Errorf("ring of %d bytes (at most %d allowed)", c.RingBytes, maxRingBytes)
	}
	c.RingBytes = max(c.RingBytes, minRingBytes)
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.Process == "" {
		c.Process = "the bridge process"
		if exe, err := os.Executable(); err == nil {
			c.Process = filepath.Base(exe)
		}
	}
	if c.proto == 0 {
		c.proto = wire.ProtocolVersion
	}
	switch c.Transport {
	case "tcp", "shm":
	default:
		return fmt.Errorf("unknown transport %q (tcp or shm)", c.Transport)
	}
	return nil
}

// member describes member i from the topology.
func (s *setup) member(i int) string {
	m := s.cfg.Members[i]
	return fmt.Sprintf("member %d (rank %d on %s)", i, m.Rank, m.Host)
}

func (s *setup) members(is []int) string {
	d := make([]string, len(is))
	for k, i := range is {
		d[k] = s.member(i)
	}
	return strings.Join(d, ", ")
}

func (s *setup) run(ctx context.Context) (Mesh, error) {
	if err := s.getSecret(ctx); err != nil {
		return nil, err
	}
	// Watch for another member's failure for the rest of the setup.
	ctx, cancel := context.WithCancelCause(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { s.watch(ctx, cancel) })
	defer wg.Wait()
	defer cancel(nil)
	switch s.cfg.Transport {
	case "shm":
		return s.establishSHM(ctx)
	default:
		return s.establishTCP(ctx)
	}
}

// getSecret makes (member 0) or reads the per-job secret and derives the
// job tag from it.
func (s *setup) getSecret(ctx context.Context) error {
	var v []byte
	if s.cfg.Self == 0 {
		b := make([]byte, 32)
		if _, err := rand.Read(b); err != nil {
			return err
		}
		// CompareSet keeps the first secret when member 0 runs again.
		cur, err := s.st.CompareSet(ctx, keySecret, nil, b)
		if err != nil {
			return s.ctxErr(ctx, err, "make the bridge secret", nil)
		}
		v = cur
	} else {
		vals, err := s.await(ctx, []string{keySecret}, []int{0}, "publish the bridge secret")
		if err != nil {
			return err
		}
		v = vals[0]
	}
	if len(v) != 32 {
		return fmt.Errorf("the bridge secret in the store has %d bytes, want 32", len(v))
	}
	s.secret = v
	s.job = jobTag(v)
	return nil
}

// jobTag identifies the job in handshakes and ring file names: a one-way
// hash of the secret, so it reveals nothing about it. (The namespace
// itself is not visible through store.Client; the secret is as unique.)
func jobTag(secret []byte) [jobTagSize]byte {
	h := sha256.New()
	h.Write([]byte("gpubridge job tag\x00"))
	h.Write(secret)
	var t [jobTagSize]byte
	copy(t[:], h.Sum(nil))
	return t
}

// watch polls the store for another member's failure and cancels ctx with
// it.
func (s *setup) watch(ctx context.Context, cancel context.CancelCauseFunc) {
	t := time.NewTicker(failPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		v, ok, err := s.st.TryGet(ctx, keyFailed)
		if err == nil && ok {
			cancel(newRemoteFailure(v))
			return
		}
	}
}

// fail records err as this member's setup failure, unless another failure
// was recorded first.
func (s *setup) fail(ctx context.Context, err error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), failWriteTime)
	defer cancel()
	msg := fmt.Sprintf("%s failed: %v", s.member(s.cfg.Self), err)
	var se *sharedError
	if errors.As(err, &se) {
		msg = se.Error()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		msg = failTimeout + msg
	}
	if _, e := s.st.CompareSet(ctx, keyFailed, nil, []byte(msg)); e != nil {
		s.log.Warn("could not record the setup failure in the store", "err", e)
	}
}

// doneCause is ctx's cause once it is done, and context.DeadlineExceeded
// once its deadline has passed even if ctx does not say so yet: a store
// call or a connection whose I/O deadline is ctx's may time out an instant
// before ctx's own timer fires (on a loaded machine, much longer), and the
// error must then be the setup timeout, not the call's i/o timeout. nil
// while ctx is live.
func doneCause(ctx context.Context) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

// ctxErr explains an error that happened while ctx may be done: another
// member's failure, the setup timeout (naming the members waited for), or
// cancellation.
func (s *setup) ctxErr(ctx context.Context, err error, what string, waitingFor []int) error {
	cause := doneCause(ctx)
	if cause == nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	var rf *remoteFailure
	if errors.As(cause, &rf) {
		return rf
	}
	if errors.Is(cause, context.DeadlineExceeded) {
		if len(waitingFor) > 0 {
			return &sharedError{fmt.Errorf("%s did not %s within %v: %w", s.members(waitingFor), what, s.cfg.Timeout, context.DeadlineExceeded)}
		}
		return fmt.Errorf("%s: no progress within %v: %w", what, s.cfg.Timeout, context.DeadlineExceeded)
	}
	return fmt.Errorf("%s: %w", what, cause)
}

// await polls the store until every key exists and returns their values.
// owners[i] is the member expected to write keys[i], named when time runs
// out.
func (s *setup) await(ctx context.Context, keys []string, owners []int, what string) ([][]byte, error) {
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
			v, ok, e := s.st.TryGet(ctx, keys[i])
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
			return nil, s.ctxErr(ctx, err, what, who)
		}
	}
}

// publish signs and writes this member's endpoint record.
func (s *setup) publish(ctx context.Context, ep endpoint) error {
	ep.MAC = ""
	b, err := json.Marshal(ep)
	if err != nil {
		return err
	}
	ep.MAC = s.recordMAC(b)
	if b, err = json.Marshal(ep); err != nil {
		return err
	}
	if err := s.st.Set(ctx, keyEndpoint+strconv.Itoa(s.cfg.Self), b); err != nil {
		return s.ctxErr(ctx, err, "publish the endpoint", nil)
	}
	return nil
}

func (s *setup) recordMAC(b []byte) string {
	h := hmac.New(sha256.New, s.secret)
	h.Write([]byte("endpoint\x00"))
	h.Write(b)
	return hex.EncodeToString(h.Sum(nil))
}

// baseEndpoint fills the fields every transport publishes.
func (s *setup) baseEndpoint() endpoint {
	me := s.cfg.Members[s.cfg.Self]
	return endpoint{Proto: int(s.proto), Transport: s.cfg.Transport, Streams: s.cfg.Streams, CRC: s.cfg.CRC,
		Member: s.cfg.Self, Rank: me.Rank, Hostname: me.Host, PID: os.Getpid()}
}

// gather reads every member's endpoint record and checks that they agree
// on the settings. Every member reads the same records, so a disagreement
// is the same error on every member.
func (s *setup) gather(ctx context.Context) ([]endpoint, error) {
	n := len(s.cfg.Members)
	keys := make([]string, n)
	owners := make([]int, n)
	for i := range keys {
		keys[i] = keyEndpoint + strconv.Itoa(i)
		owners[i] = i
	}
	vals, err := s.await(ctx, keys, owners, "publish its endpoint")
	if err != nil {
		return nil, err
	}
	eps := make([]endpoint, n)
	for i, v := range vals {
		if eps[i], err = parseEndpoint(v); err != nil {
			return nil, fmt.Errorf("%s published a bad endpoint record: %w", s.member(i), err)
		}
	}
	var diffs []string
	diff := func(what string, val func(e *endpoint) string) {
		first := val(&eps[0])
		same := true
		for i := range eps {
			same = same && val(&eps[i]) == first
		}
		if !same {
			parts := make([]string, n)
			for i := range eps {
				parts[i] = s.member(i) + " " + val(&eps[i])
			}
			diffs = append(diffs, what+": "+strings.Join(parts, ", "))
		}
	}
	diff("bridge protocol", func(e *endpoint) string { return "v" + strconv.Itoa(e.Proto) })
	diff("transport", func(e *endpoint) string { return e.Transport })
	diff("streams per peer", func(e *endpoint) string { return strconv.Itoa(e.Streams) })
	diff("crc", func(e *endpoint) string {
		if e.CRC {
			return "on"
		}
		return "off"
	})
	if len(diffs) > 0 {
		return nil, &sharedError{fmt.Errorf("members disagree on the bridge settings: %s", strings.Join(diffs, "; "))}
	}
	for i := range eps {
		e := eps[i]
		mac := e.MAC
		e.MAC = ""
		b, _ := json.Marshal(e)
		if want := s.recordMAC(b); !hmac.Equal([]byte(want), []byte(mac)) {
			return nil, &sharedError{fmt.Errorf("the endpoint record of %s is not signed with this job's secret (written by a stranger, or a member of another job)", s.member(i))}
		}
		me := s.cfg.Members[i]
		if e.Member != i || e.Rank != me.Rank || e.Hostname != me.Host {
			return nil, fmt.Errorf("the endpoint record of %s says member %d, rank %d on %s: the members have different topologies", s.member(i), e.Member, e.Rank, e.Hostname)
		}
	}
	return eps, nil
}

// barrier marks this member ready and waits for every other member.
func (s *setup) barrier(ctx context.Context) error {
	if err := s.st.Set(ctx, keyReady+strconv.Itoa(s.cfg.Self), []byte("1")); err != nil {
		return s.ctxErr(ctx, err, "mark this member ready", nil)
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

func (s *setup) hsParams() *hsParams {
	return &hsParams{secret: s.secret, job: s.job, version: s.proto, self: s.cfg.Self, size: len(s.cfg.Members), streams: s.cfg.Streams}
}

func (s *setup) establishTCP(ctx context.Context) (Mesh, error) {
	ip, ifname, err := listenAddr(ctx, &s.cfg)
	if err != nil {
		return nil, err
	}
	lc := net.ListenConfig{Control: sockControl, KeepAliveConfig: keepAlive}
	l, err := lc.Listen(ctx, "tcp", net.JoinHostPort(ip.String(), "0"))
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", ip, err)
	}
	ln := l.(*net.TCPListener)
	tc := s.startTCP(ctx, ln)
	stopped := false
	defer func() {
		if !stopped {
			tc.stop()
		}
	}()
	ep := s.baseEndpoint()
	ep.IP, ep.Port, ep.Interface = ip.String(), ln.Addr().(*net.TCPAddr).Port, ifname
	s.log.Debug("bridge listening", "member", s.cfg.Self, "addr", ln.Addr(), "interface", ifname)
	if err := s.publish(ctx, ep); err != nil {
		return nil, err
	}
	eps, err := s.gather(ctx)
	if err != nil {
		return nil, err
	}
	peers := make([]string, len(eps))
	procs := make([]string, len(eps))
	for i, e := range eps {
		peers[i] = fmt.Sprintf("member %d (rank %d on %s %s)", i, e.Rank, e.Hostname, net.JoinHostPort(e.IP, strconv.Itoa(e.Port)))
		procs[i] = fmt.Sprintf("%s of rank %d (pid %d on %s)", s.cfg.Process, e.Rank, e.PID, e.Hostname)
	}
	stopped = true
	conns, err := tc.connect(ip, eps, peers)
	if err != nil {
		return nil, err
	}
	if err := s.barrier(ctx); err != nil {
		closeConns(conns)
		return nil, err
	}
	crc := "no crc"
	if s.cfg.CRC {
		crc = "crc32c"
	}
	via := ip.String()
	if ifname != "" {
		via = ifname + " " + via
	}
	desc := fmt.Sprintf("tcp, %d streams per peer, %s, via %s", s.cfg.Streams, crc, via)
	return newTCPMesh(s.cfg.Self, s.cfg.Streams, s.cfg.CRC, desc, peers, procs, conns, s.log), nil
}

func closeConns(conns [][]*net.TCPConn) {
	for _, cs := range conns {
		for _, c := range cs {
			if c != nil {
				_ = c.Close()
			}
		}
	}
}

// tcpConnector makes every connection of this member: it accepts Streams+1
// connections from each member with a larger index (from the moment it
// listens, so that nobody waits on a member still gathering records) and
// dials as many to each member with a smaller one, each authenticated by a
// handshake.
type tcpConnector struct {
	s       *setup
	ln      *net.TCPListener
	hp      *hsParams
	ctx     context.Context
	cancel  context.CancelFunc
	results chan connResult
	wg      sync.WaitGroup
	want    int

	pending *pendingSet
	logs    *logLimiter

	mu      sync.Mutex
	claimed map[[2]int]bool
	lastErr map[int]error
}

type connResult struct {
	peer, stream int
	c            *net.TCPConn
	err          error
}

func (s *setup) startTCP(ctx context.Context, ln *net.TCPListener) *tcpConnector {
	n, self, per := len(s.cfg.Members), s.cfg.Self, s.cfg.Streams+1
	c := &tcpConnector{s: s, ln: ln, hp: s.hsParams(), want: n*per - per,
		// Room for every connection the members with larger indices owe
		// this listener, and maxPendingHS more.
		pending: newPendingSet(maxPendingHS + (n-1-self)*per), logs: newLogLimiter(),
		claimed: make(map[[2]int]bool), lastErr: make(map[int]error)}
	c.ctx, c.cancel = context.WithCancel(ctx)
	c.results = make(chan connResult, c.want)
	if self < n-1 {
		c.wg.Go(c.acceptLoop)
	}
	return c
}

func (c *tcpConnector) acceptLoop() {
	for {
		conn, err := c.ln.Accept()
		if err != nil {
			return
		}
		pc := &pendingConn{conn: conn.(*net.TCPConn), since: time.Now()}
		if dl, ok := c.ctx.Deadline(); ok {
			pc.ctxDL = dl
		}
		pc.extend(helloTimeout)
		victim, ok := c.pending.admit(pc)
		if !ok {
			// Only members' authenticated connections hold the slots.
			c.logs.log(c.s.log, slog.LevelWarn, "full", "refused bridge connection: too many handshakes in progress", "from", conn.RemoteAddr().String())
			_ = conn.Close()
			continue
		}
		if victim != nil {
			c.logs.log(c.s.log, slog.LevelWarn, "evict", "closed an unauthenticated bridge connection to make room for a new one (too many handshakes in progress: strangers connecting?)",
				"from", victim.conn.RemoteAddr().String(), "pending", c.pending.limit)
		}
		c.wg.Go(func() { c.handshake(pc) })
	}
}

// handshake runs the server handshake on an admitted connection and hands
// the connection on, or closes it and logs why.
func (c *tcpConnector) handshake(pc *pendingConn) {
	defer c.pending.remove(pc)
	from, st, err := c.s.accept(c.ctx, pc, c.hp, c.claim, c.unclaim)
	if err == nil {
		c.results <- connResult{peer: from, stream: st, c: pc.conn}
		return
	}
	_ = pc.conn.Close()
	stage, evicted := pc.state()
	var ve *versionError
	switch {
	case evicted:
		// Logged when it was evicted.
	case c.ctx.Err() != nil:
		// The setup is over (done or failed): nothing to refuse.
	case stage == stageHello:
		// No hello with this job's tag: a stranger (or a member of
		// another job). Not worth more than a rate-limited warning.
		c.logs.log(c.s.log, slog.LevelWarn, "stranger", "refused bridge connection: no hello of this job (a stranger, or a member of another job)",
			"from", pc.conn.RemoteAddr().String(), "err", err)
	case errors.As(err, &ve):
		// This job's tag in another protocol version: most likely a
		// member started from another gbbridge build.
		c.logs.log(c.s.log, slog.LevelError, "version", "refused bridge connection", "from", pc.conn.RemoteAddr().String(), "err", err)
	default:
		c.logs.log(c.s.log, slog.LevelWarn, "refused", "refused bridge connection", "from", pc.conn.RemoteAddr().String(), "err", err)
	}
}

func (c *tcpConnector) claim(from, st int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.claimed[[2]int{from, st}] {
		return fmt.Errorf("member %d already has a connection for stream %d", from, st)
	}
	c.claimed[[2]int{from, st}] = true
	return nil
}

func (c *tcpConnector) unclaim(from, st int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.claimed, [2]int{from, st})
}

func (c *tcpConnector) noteErr(p int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lastErr[p] = err
}

// stop ends the accepting and dialing and closes what came too late.
func (c *tcpConnector) stop() {
	c.cancel()
	_ = c.ln.Close()
	c.wg.Wait()
	close(c.results)
	for r := range c.results {
		if r.c != nil {
			_ = r.c.Close()
		}
	}
}

// connect dials the members with smaller indices and collects every
// connection. It stops the connector.
func (c *tcpConnector) connect(ip net.IP, eps []endpoint, peers []string) ([][]*net.TCPConn, error) {
	s := c.s
	n, self, per := len(eps), s.cfg.Self, s.cfg.Streams+1
	conns := make([][]*net.TCPConn, n)
	for p := range conns {
		if p != self {
			conns[p] = make([]*net.TCPConn, per)
		}
	}
	for p := range self {
		for st := range per {
			c.wg.Go(func() {
				conn, err := s.dial(c.ctx, ip, eps[p], c.hp, p, st, func(err error) { c.noteErr(p, err) })
				if err != nil {
					err = fmt.Errorf("connect to %s, stream %d: %w", peers[p], st, err)
				}
				c.results <- connResult{peer: p, stream: st, c: conn, err: err}
			})
		}
	}
	var err error
	for got := 0; got < c.want && err == nil; {
		select {
		case r := <-c.results:
			if r.err != nil {
				err = r.err
				break
			}
			conns[r.peer][r.stream] = r.c
			got++
		case <-c.ctx.Done():
			err = c.timeout(conns, peers)
		}
	}
	c.stop()
	if err != nil {
		closeConns(conns)
		return nil, err
	}
	return conns, nil
}

// timeout explains which connections are missing when time ran out.
func (c *tcpConnector) timeout(conns [][]*net.TCPConn, peers []string) error {
	s, ctx := c.s, c.ctx
	var missing []string
	var who []int
	for p, cs := range conns {
		if p == s.cfg.Self {
			continue
		}
		k := 0
		for _, c := range cs {
			if c == nil {
				k++
			}
		}
		if k == 0 {
			continue
		}
		who = append(who, p)
		dir := "from"
		if p < s.cfg.Self {
			dir = "to"
		}
		m := fmt.Sprintf("%s %s: %d of %d", dir, peers[p], k, len(cs))
		c.mu.Lock()
		if e := c.lastErr[p]; e != nil {
			m += fmt.Sprintf(" (last error: %v)", e)
		}
		c.mu.Unlock()
		missing = append(missing, m)
	}
	err := s.ctxErr(ctx, context.DeadlineExceeded, "connect", who)
	var rf *remoteFailure
	if errors.As(err, &rf) || !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return fmt.Errorf("connections missing after %v: %s: %w", s.cfg.Timeout, strings.Join(missing, "; "), context.DeadlineExceeded)
}

// dial connects to member p's stream st and runs the client handshake,
// dialing again with backoff until ctx ends when the connection is
// refused, or closed before member p took it (its listener sheds
// unauthenticated connections when strangers crowd it).
func (s *setup) dial(ctx context.Context, ip net.IP, ep endpoint, hp *hsParams, p, st int, noteErr func(error)) (*net.TCPConn, error) {
	addr := net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port))
	d := net.Dialer{Control: sockControl, LocalAddr: &net.TCPAddr{IP: ip}, KeepAliveConfig: keepAlive}
	backoff := 5 * time.Millisecond
	for {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			tc := c.(*net.TCPConn)
			_ = tc.SetNoDelay(true)
			err = handshakeWithin(ctx, tc, func() error { return clientHandshake(tc, hp, p, st) })
			if err == nil {
				return tc, nil
			}
			_ = tc.Close()
			var ue *unansweredError
			if !errors.As(err, &ue) && doneCause(ctx) == nil {
				return nil, err
			}
			s.log.Debug("bridge connection closed before the handshake completed; dialing again", "member", p, "stream", st, "err", err)
		}
		noteErr(err)
		if doneCause(ctx) != nil {
			return nil, s.ctxErr(ctx, err, "connect", []int{p})
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
		backoff = min(2*backoff, 200*time.Millisecond)
	}
}

// accept runs the server handshake on an admitted connection: its hello
// within helloTimeout, the rest within hsTimeout, all within ctx.
func (s *setup) accept(ctx context.Context, pc *pendingConn, hp *hsParams, claim func(int, int) error, unclaim func(int, int)) (int, int, error) {
	c := pc.conn
	_ = c.SetNoDelay(true)
	stop := context.AfterFunc(ctx, func() { pc.stop(false) })
	var from, st int
	claimed := false
	from, st, err := serverHandshake(c, hp, serverHooks{
		tagged: func() {
			pc.setStage(stageTagged)
			pc.extend(hsTimeout)
		},
		claim: func(f, i int) error {
			if err := claim(f, i); err != nil {
				return err
			}
			claimed = true
			from, st = f, i
			pc.setStage(stageAuthed)
			return nil
		},
	})
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err == nil && !pc.finish() {
		err = errors.New("handshake stopped")
	}
	if err != nil && claimed {
		unclaim(from, st)
	}
	return from, st, err
}

// handshakeWithin runs f with c's deadline at the earlier of ctx's and
// hsTimeout from now; ctx's cancellation interrupts it.
func handshakeWithin(ctx context.Context, c net.Conn, f func() error) error {
	dl := time.Now().Add(hsTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	_ = c.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(pastDeadline) })
	err := f()
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err == nil {
		err = c.SetDeadline(time.Time{})
	}
	return err
}
