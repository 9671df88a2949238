// Command vmcheck runs the two-host checks of the soft-RoCE VM lane
// (ci/vm): one process per guest, member 0 in guest a (which serves the
// store), member 1 in guest b, over two rdma_rxe devices on the two ends
// of a virtual link. Each subcommand checks what its member should see
// and exits 0 when it did, 1 when not (the reason on stderr), printing one
// JSON line of what it measured.
//
//	vmcheck allreduce -store H:P -rank R -ns NS   bit-exact all_reduce over verbs, then send/recv striped over its point-to-point streams
//	vmcheck feed      -store H:P -rank R -ns NS   gbprobe | gbdiscover (auto picks verbs) | gbbridge serve, fed by the Go feed client
//	vmcheck kill      -store H:P -rank R -ns NS   member 1 is SIGKILLed mid-collective; member 0's error names it
//	vmcheck linkdown  -store H:P -rank R -ns NS   member 1's link goes down mid-transfer; both errors name the peer
//	vmcheck probe     FILE                        gbprobe's JSON shows the rxe device as libibverbs opens it
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/collective"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/feed"
	"github.com/gpubridge/gpubridge/lib/feed/feedtest"
	"github.com/gpubridge/gpubridge/lib/probe"
	"github.com/gpubridge/gpubridge/lib/reduce"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

type opts struct {
	store, ns, iface, bin string
	rank                  int
	timeout               time.Duration
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: vmcheck allreduce|feed|kill|linkdown|probe ...")
		os.Exit(2)
	}
	cmd := os.Args[1]
	if cmd == "probe" {
		exit(checkProbe(os.Args[2:]))
	}
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	var o opts
	fs.StringVar(&o.store, "store", "10.9.0.1:29500", "the store")
	fs.IntVar(&o.rank, "rank", 0, "this member (0 in guest a, 1 in guest b)")
	fs.StringVar(&o.ns, "ns", cmd, "key namespace")
	fs.StringVar(&o.iface, "iface", "eth0", "the link linkdown takes down")
	fs.StringVar(&o.bin, "bin", "/gb/bin", "where gbprobe, gbdiscover and gbbridge are")
	fs.DurationVar(&o.timeout, "timeout", 0, "set-up and collective deadline (default 120 s, scaled)")
	_ = fs.Parse(os.Args[2:])
	if o.timeout == 0 {
		o.timeout = testenv.Scale(120 * time.Second)
	}
	switch cmd {
	case "allreduce":
		exit(allReduce(o))
	case "feed":
		exit(feedPath(o))
	case "kill":
		exit(kill(o))
	case "linkdown":
		exit(linkDown(o))
	}
	fmt.Fprintln(os.Stderr, "vmcheck: unknown command", cmd)
	os.Exit(2)
}

func exit(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmcheck:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func report(v any) {
	b, _ := json.Marshal(v)
	fmt.Println(string(b))
}

// join makes this process member o.rank of 2 over verbs.
func join(o opts, streams int) (*bridge.Member, error) {
	return bridge.Join(context.Background(), bridge.Config{Store: o.store, Namespace: o.ns, Size: 2,
		Mesh: transport.Config{Self: o.rank, Transport: transport.Verbs, Streams: streams, Timeout: o.timeout, RingBytes: 2 << 20, Process: "vmcheck"},
		Comm: collective.Options{ChunkBytes: 1 << 20, Timeout: o.timeout}})
}

// input is member r's input for case c: both members know both.
func input(c, r int, dt reduce.DType, elems int) []byte {
	b := make([]byte, elems*dt.Size())
	x := uint64(c*1_000_003 + r*7919 + 1)
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
	// Random bits, NaNs and infinities included: the reference reduction
	// decides every bit.
	return b
}

// allReduce runs all_reduce over verbs on sizes from one element to
// several chunks and checks every bit against the reference.
func allReduce(o opts) error {
	m, err := join(o, 4)
	if err != nil {
		return err
	}
	defer m.Leave(10 * time.Second)
	desc := m.Mesh.Describe()
	if !strings.HasPrefix(desc, "verbs, ") {
		return fmt.Errorf("the mesh is %q, not verbs", desc)
	}
	cases := []struct {
		dt    reduce.DType
		op    reduce.Op
		elems int
	}{
		{reduce.Float32, reduce.Sum, 1}, {reduce.Float32, reduce.Sum, 1021}, {reduce.Float32, reduce.Sum, 1<<20 + 3},
		{reduce.BFloat16, reduce.Sum, 65537}, {reduce.Int64, reduce.Max, 100003}, {reduce.Float64, reduce.Min, 7},
		{reduce.Uint8, reduce.Sum, 3 << 20},
	}
	ctx := context.Background()
	var bytesDone int64
	t0 := time.Now()
	for i, c := range cases {
		in := [][]byte{input(i, 0, c.dt, c.elems), input(i, 1, c.dt, c.elems)}
		want := collective.ReferenceAllReduce(c.op, c.dt, in, 2)
		buf := append([]byte(nil), in[o.rank]...)
		if err := m.Comm.AllReduce(ctx, buf, c.dt, c.op, nil); err != nil {
			return fmt.Errorf("all_reduce %s %s of %d elements: %w", c.dt, c.op, c.elems, err)
		}
		if !bytes.Equal(buf, want) {
			return fmt.Errorf("all_reduce %s %s of %d elements: the result differs from the reference", c.dt, c.op, c.elems)
		}
		bytesDone += int64(len(buf))
	}
	p2pBytes, err := sendRecv(ctx, m.Comm, o.rank, desc)
	if err != nil {
		return err
	}
	report(map[string]any{"check": "allreduce", "rank": o.rank, "transport": desc, "cases": len(cases), "bytes": bytesDone,
		"p2p_bytes": p2pBytes, "seconds": time.Since(t0).Seconds(), "bit_exact": true})
	return nil
}

// sendRecv sends a message each way at once, large enough (from 512 KiB)
// to be striped over the mesh's point-to-point streams (lib/bridge asks
// for transport.DefaultP2PStreams; Describe says how many it has), one
// of them ending in a short frame, and checks every byte received.
func sendRecv(ctx context.Context, c *collective.Comm, rank int, desc string) (int, error) {
	if want := fmt.Sprintf(" and %d for point-to-point", transport.DefaultP2PStreams); !strings.Contains(desc, want) {
		return 0, fmt.Errorf("the mesh is %q: no%s streams", desc, want)
	}
	peer, total := 1-rank, 0
	for i, size := range []int{4 << 20, 3<<20 + 13} {
		out := input(100+i, rank, reduce.Uint8, size)
		want := input(100+i, peer, reduce.Uint8, size)
		got := make([]byte, size)
		tag := uint32(7 + i)
		sent := make(chan error, 1)
		go func() { sent <- c.Send(ctx, peer, tag, out) }()
		n, err := c.Recv(ctx, peer, tag, got)
		if serr := <-sent; err == nil {
			err = serr
		}
		if err != nil {
			return total, fmt.Errorf("send/recv of %d bytes: %w", size, err)
		}
		if n != size || !bytes.Equal(got, want) {
			return total, fmt.Errorf("send/recv of %d bytes: %d bytes arrived, not those member %d sent", size, n, peer)
		}
		total += size
	}
	return total, nil
}

// kill: member 1 kills itself (SIGKILL, as kill -9 would) once part of an
// all_reduce's result is final; member 0 must fail naming it.
func kill(o opts) error {
	m, err := join(o, 2)
	if err != nil {
		return err
	}
	buf := input(1, o.rank, reduce.Float32, 8<<20)
	var p *collective.Progress
	if o.rank == 1 {
		var once atomic.Bool
		p = &collective.Progress{Done: func(off, n int) {
			if once.CompareAndSwap(false, true) {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				time.Sleep(time.Hour)
			}
		}}
	}
	t0 := time.Now()
	err = m.Comm.AllReduce(context.Background(), buf, reduce.Float32, reduce.Sum, p)
	took := time.Since(t0)
	_ = m.Close()
	if o.rank == 1 {
		return fmt.Errorf("member 1 was to die mid-collective, it returned %v", err)
	}
	return expectPeerNamed(err, "kill", took, "member 1 (rank 1 on ")
}

// linkDown: member 1 takes its link down once part of the result is
// final; both members must fail naming the other within the deadline.
func linkDown(o opts) error {
	m, err := join(o, 2)
	if err != nil {
		return err
	}
	buf := input(2, o.rank, reduce.Float32, 8<<20)
	var p *collective.Progress
	if o.rank == 1 {
		var once atomic.Bool
		p = &collective.Progress{Done: func(off, n int) {
			if once.CompareAndSwap(false, true) {
				if out, err := exec.Command("/usr/sbin/ip", "link", "set", o.iface, "down").CombinedOutput(); err != nil {
					fmt.Fprintf(os.Stderr, "vmcheck: ip link set %s down: %v: %s\n", o.iface, err, out)
				}
			}
		}}
	}
	t0 := time.Now()
	err = m.Comm.AllReduce(context.Background(), buf, reduce.Float32, reduce.Sum, p)
	took := time.Since(t0)
	_ = m.Close()
	peer := "member 1 (rank 1 on "
	if o.rank == 1 {
		peer = "member 0 (rank 0 on "
	}
	return expectPeerNamed(err, "linkdown", took, peer)
}

func expectPeerNamed(err error, check string, took time.Duration, peer string) error {
	if err == nil {
		return fmt.Errorf("%s: the collective succeeded", check)
	}
	if !strings.Contains(err.Error(), peer) {
		return fmt.Errorf("%s: the error does not name %q: %v", check, peer, err)
	}
	report(map[string]any{"check": check, "error": err.Error(), "seconds": took.Seconds()})
	return nil
}

// feedPath is the plugin's path with the Go feed client in the place of
// the Python plugin: gbprobe | gbdiscover (simulated vendors: nvidia in
// guest a, amd in guest b; bridge auto must pick verbs), gbbridge serve on
// each leader, and an all_reduce through the feed's shared memory.
func feedPath(o opts) error {
	dir, err := os.MkdirTemp("", "vmfeed")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	vendor := []string{"nvidia", "amd"}[o.rank]
	env := append(os.Environ(), "GPUBRIDGE_VENDOR="+vendor)
	probeOut, err := runTool(env, nil, filepath.Join(o.bin, "gbprobe"), "--json")
	if err != nil {
		return err
	}
	topoJSON, err := runTool(env, probeOut, filepath.Join(o.bin, "gbdiscover"), "--store", o.store, "--rank", fmt.Sprint(o.rank),
		"--world-size", "2", "--namespace", o.ns, "--bridge", "auto", "--timeout", o.timeout.String())
	if err != nil {
		return err
	}
	var topo discover.Topology
	if err := json.Unmarshal(topoJSON, &topo); err != nil {
		return fmt.Errorf("topology: %w", err)
	}
	if topo.Bridge.Transport != transport.Verbs {
		return fmt.Errorf("bridge auto picked %s (%s), not verbs", topo.Bridge.Transport, topo.Bridge.Reason)
	}
	topoFile := filepath.Join(dir, "topo.json")
	if err := os.WriteFile(topoFile, topoJSON, 0o600); err != nil {
		return err
	}
	sock := filepath.Join(dir, "feed.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 2*o.timeout)
	defer cancel()
	serve := exec.CommandContext(ctx, filepath.Join(o.bin, "gbbridge"), "serve", "--topology", topoFile, "--feed", sock,
		"--store", o.store, "--streams", "2", "--chunk", "1M", "--timeout", o.timeout.String(), "--setup-timeout", o.timeout.String())
	// At debug level serve logs each region it maps, and whether the RDMA
	// device registered it (sends without staging): checked below.
	serve.Env = append(env, "GPUBRIDGE_LOG_LEVEL=debug")
	var logs bytes.Buffer
	serve.Stderr = io.MultiWriter(os.Stderr, &logs)
	out, err := serve.StdoutPipe()
	if err != nil {
		return err
	}
	if err := serve.Start(); err != nil {
		return err
	}
	sc := bufio.NewScanner(out)
	if !sc.Scan() {
		_ = serve.Wait()
		return errors.New("gbbridge serve printed no ready line")
	}
	var ready feed.ReadyLine
	if err := json.Unmarshal(sc.Bytes(), &ready); err != nil {
		return fmt.Errorf("ready line %q: %w", sc.Text(), err)
	}
	if !strings.HasPrefix(ready.Transport, "verbs, ") {
		return fmt.Errorf("gbbridge serve runs %q, not verbs", ready.Transport)
	}
	c, err := feedtest.Dial(ctx, ready.Feed)
	if err != nil {
		return err
	}
	const elems = 3<<20 + 5
	region, err := c.Map(ctx, 4*elems)
	if err != nil {
		return err
	}
	in := [][]byte{input(3, 0, reduce.Float32, elems), input(3, 1, reduce.Float32, elems)}
	want := collective.ReferenceAllReduce(reduce.Sum, reduce.Float32, in, 2)
	copy(region.Mem, in[o.rank])
	t0 := time.Now()
	if err := c.AllReduce(ctx, region.All(), reduce.Float32, reduce.Sum); err != nil {
		return fmt.Errorf("feed all_reduce: %w", err)
	}
	took := time.Since(t0)
	if !bytes.Equal(region.Mem, want) {
		return errors.New("feed all_reduce: the result differs from the reference")
	}
	if err := c.Release(ctx, region); err != nil {
		return err
	}
	if err := c.Close(ctx); err != nil {
		return err
	}
	if err := serve.Wait(); err != nil {
		return fmt.Errorf("gbbridge serve: %w", err)
	}
	if !strings.Contains(logs.String(), "registered=true") {
		return errors.New("gbbridge serve did not register the feed region with the RDMA device (no \"registered=true\" in its log)")
	}
	report(map[string]any{"check": "feed", "rank": o.rank, "bridge": topo.Bridge.Reason, "transport": ready.Transport,
		"bytes": 4 * elems, "seconds": took.Seconds(), "bit_exact": true})
	return nil
}

func runTool(env []string, stdin []byte, name string, args ...string) ([]byte, error) {
	cmd := exec.Command(name, args...)
	cmd.Env = env
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s: %w: %s", filepath.Base(name), err, stderr.String())
	}
	return out, nil
}

// checkProbe checks gbprobe's report of the guest: an rxe device whose
// port libibverbs opens, active, on Ethernet, with RoCE v2 GIDs on eth0,
// and the rdma requirement met.
func checkProbe(args []string) error {
	if len(args) != 1 {
		return errors.New("usage: vmcheck probe FILE")
	}
	b, err := os.ReadFile(args[0])
	if err != nil {
		return err
	}
	var rep probe.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return err
	}
	if rep.Verbs.State != probe.VerbsOK {
		return fmt.Errorf("libibverbs: %s (%s)", rep.Verbs.State, rep.Verbs.Error)
	}
	for _, d := range rep.RDMA {
		if !strings.HasPrefix(d.Name, "rxe") {
			continue
		}
		if d.Verbs == nil || !d.Verbs.Opened {
			return fmt.Errorf("%s: libibverbs did not open it: %+v", d.Name, d.Verbs)
		}
		for _, p := range d.Ports {
			v2 := false
			for _, g := range p.GIDs {
				v2 = v2 || g.Type == "RoCE v2" && g.Netdev != ""
			}
			switch {
			case !p.Active() || p.LinkLayer != "Ethernet" || !v2:
				return fmt.Errorf("%s port %d: %s %s, GIDs %+v", d.Name, p.Port, p.State, p.LinkLayer, p.GIDs)
			case p.ActiveMTU == 0:
				return fmt.Errorf("%s port %d: no active MTU from libibverbs", d.Name, p.Port)
			}
		}
		for _, r := range rep.Requirements {
			if !r.OK {
				return fmt.Errorf("requirement %s failed: %s", r.Require, r.Reason)
			}
		}
		report(map[string]any{"check": "probe", "device": d.Name, "ports": d.Ports, "requirements": rep.Requirements})
		return nil
	}
	return errors.New("no rxe device in the report")
}
