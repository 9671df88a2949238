package transport

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
)

// Setting up the TCP transport: every member listens, publishes its
// address in its endpoint record, and members connect in pairs (the one
// with the larger index dials), Streams+1 connections per pair, each
// opened with a mutually authenticated handshake (tcp_handshake.go) and
// admitted past strangers (tcp_admit.go).

func init() { register(&driver{kind: TCP, establish: establishTCP}) }

const (
	helloTimeout = 2 * time.Second  // an accepted connection's hello must arrive within this
	hsTimeout    = 10 * time.Second // bounds one connection handshake
	maxPendingHS = 64               // handshakes in progress on one listener beyond the members' own (tcp_admit.go)
)

// tcpEndpoint is a TCP member's endpoint record: where it listens.
type tcpEndpoint struct {
	endpoint
	IP        string `json:"ip,omitempty"`
	Port      int    `json:"port,omitempty"`
	Interface string `json:"interface,omitempty"`
}

func (s *setup) hsParams() *hsParams {
	return &hsParams{secret: s.rv.Secret(), job: s.job, version: s.proto, self: s.cfg.Self, size: len(s.cfg.Members), streams: s.cfg.wireStreams()}
}

func establishTCP(ctx context.Context, s *setup) (Mesh, error) {
	ip, ifname, err := listenAddr(ctx, &s.cfg)
	if err != nil {
		return nil, err
	}
	lc := net.ListenConfig{Control: sockControl(sockBufFor(&s.cfg)), KeepAliveConfig: keepAlive}
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
	ep := tcpEndpoint{endpoint: s.endpoint(), IP: ip.String(), Port: ln.Addr().(*net.TCPAddr).Port, Interface: ifname}
	s.log.Debug("bridge listening", "member", s.cfg.Self, "addr", ln.Addr(), "interface", ifname)
	if err := s.rv.Publish(ctx, ep); err != nil {
		return nil, err
	}
	eps, err := gather[tcpEndpoint](ctx, s)
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
	if err := s.rv.Barrier(ctx); err != nil {
		closeConns(conns)
		return nil, err
	}
	via := ip.String()
	if ifname != "" {
		via = ifname + " " + via
	}
	desc := fmt.Sprintf("tcp, %d streams per peer%s, %s, via %s", s.cfg.Streams, p2pWords(s.cfg.P2PStreams), crcWords(s.cfg.CRC), via)
	return newTCPMesh(s.cfg.Self, s.cfg.Streams, s.cfg.P2PStreams, s.cfg.CRC, desc, peers, procs, conns, s.log), nil
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
	n, self, per := len(s.cfg.Members), s.cfg.Self, s.cfg.wireStreams()+1
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
func (c *tcpConnector) connect(ip net.IP, eps []tcpEndpoint, peers []string) ([][]*net.TCPConn, error) {
	s := c.s
	n, self, per := len(eps), s.cfg.Self, s.cfg.wireStreams()+1
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
	err := s.rv.Explain(ctx, context.DeadlineExceeded, "connect", who...)
	var re *rendezvous.RemoteError
	if errors.As(err, &re) || !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return fmt.Errorf("connections missing after %v: %s: %w", s.cfg.Timeout, strings.Join(missing, "; "), context.DeadlineExceeded)
}

// dial connects to member p's stream st and runs the client handshake,
// dialing again with backoff until ctx ends when the connection is
// refused, or closed before member p took it (its listener sheds
// unauthenticated connections when strangers crowd it).
func (s *setup) dial(ctx context.Context, ip net.IP, ep tcpEndpoint, hp *hsParams, p, st int, noteErr func(error)) (*net.TCPConn, error) {
	addr := net.JoinHostPort(ep.IP, strconv.Itoa(ep.Port))
	d := net.Dialer{Control: sockControl(sockBufFor(&s.cfg)), LocalAddr: &net.TCPAddr{IP: ip}, KeepAliveConfig: keepAlive}
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
			if !errors.As(err, &ue) && rendezvous.DoneCause(ctx) == nil {
				return nil, err
			}
			s.log.Debug("bridge connection closed before the handshake completed; dialing again", "member", p, "stream", st, "err", err)
		}
		noteErr(err)
		if rendezvous.DoneCause(ctx) != nil {
			return nil, s.rv.Explain(ctx, err, "connect", p)
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
