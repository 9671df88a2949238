package discover

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/transport"
)

// mk builds n records; vendors[i] is rank i's vendor, hosts[i] its host
// (defaults: nvidia, "h0").
func mk(vendors []string, hosts []string) []*Record {
	recs := make([]*Record, len(vendors))
	for i, v := range vendors {
		h := "h0"
		if i < len(hosts) {
			h = hosts[i]
		}
		recs[i] = &Record{
			Schema: RecordSchema, Rank: i, WorldSize: len(vendors), LocalRank: i, Hostname: h,
			ToolVersion: "1.0", Vendor: v, Mode: ModeGPU, Bridge: BridgeAuto,
			GPU: &GPU{Index: i, UUID: fmt.Sprintf("GPU-%d", i), PCI: fmt.Sprintf("0000:%02x:00.0", i)},
		}
	}
	return recs
}

func nv(n int) []string {
	s := make([]string, n)
	for i := range s {
		s[i] = VendorNVIDIA
	}
	return s
}

func TestDecideTopologies(t *testing.T) {
	tests := []struct {
		name      string
		recs      func() []*Record
		kind      string
		islands   map[string][]int
		leaders   []int
		transport transport.Kind
	}{
		{"2+2 one host", func() []*Record { return mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil) },
			KindGPUMixed, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}}, []int{0, 2}, BridgeSHM},
		{"3+1 two hosts", func() []*Record {
			return mk([]string{"nvidia", "nvidia", "nvidia", "amd"}, []string{"a", "a", "a", "b"})
		}, KindGPUMixed, map[string][]int{"nvidia": {0, 1, 2}, "amd": {3}}, []int{0, 3}, BridgeTCP},
		{"interleaved vendors", func() []*Record { return mk([]string{"amd", "nvidia", "amd", "nvidia"}, nil) },
			KindGPUMixed, map[string][]int{"amd": {0, 2}, "nvidia": {1, 3}}, []int{0, 1}, BridgeSHM},
		{"single vendor", func() []*Record { return mk(nv(4), nil) },
			KindGPUSingleVendor, map[string][]int{"nvidia": {0, 1, 2, 3}}, []int{0}, BridgeNone},
		{"single rank", func() []*Record { return mk(nv(1), nil) },
			KindGPUSingleVendor, map[string][]int{"nvidia": {0}}, []int{0}, BridgeNone},
		{"split half", func() []*Record {
			r := mk(nv(4), nil)
			for _, x := range r {
				x.SplitTest = SplitHalf
			}
			return r
		}, KindSplitTest, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}}, []int{0, 2}, BridgeSHM},
		{"split alternate", func() []*Record {
			r := mk(nv(4), nil)
			for _, x := range r {
				x.SplitTest = SplitAlternate
			}
			return r
		}, KindSplitTest, map[string][]int{"nvidia": {0, 2}, "amd": {1, 3}}, []int{0, 1}, BridgeSHM},
		{"split node", func() []*Record {
			r := mk(nv(4), []string{"a", "a", "b", "b"})
			for _, x := range r {
				x.SplitTest = SplitNode
			}
			return r
		}, KindSplitTest, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}}, []int{0, 2}, BridgeTCP},
		{"cpu simulation", func() []*Record {
			r := mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil)
			for _, x := range r {
				x.Mode, x.Simulated, x.GPU = ModeCPU, true, nil
			}
			return r
		}, KindCPU, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}}, []int{0, 2}, BridgeSHM},
		{"two hosts with RoCE: verbs", func() []*Record {
			r := mk([]string{"nvidia", "nvidia", "amd", "amd"}, []string{"a", "a", "b", "b"})
			for _, x := range r {
				x.Probe.Verbs, x.Probe.VerbsPorts = "ok", []VerbsPort{{Device: "rxe0", Port: 1, LinkLayer: "Ethernet"}}
			}
			return r
		}, KindGPUMixed, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}}, []int{0, 2}, BridgeVerbs},
		{"two hosts, a leader without libibverbs: tcp", func() []*Record {
			r := mk([]string{"nvidia", "nvidia", "amd", "amd"}, []string{"a", "a", "b", "b"})
			for _, x := range r {
				x.Probe.Verbs, x.Probe.VerbsPorts = "ok", []VerbsPort{{Device: "rxe0", Port: 1, LinkLayer: "Ethernet"}}
			}
			r[2].Probe.Verbs, r[2].Probe.VerbsError, r[2].Probe.VerbsPorts = "unavailable", "libibverbs.so.1: not found", nil
			return r
		}, KindGPUMixed, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}}, []int{0, 2}, BridgeTCP},
		{"cpu simulation, three islands", func() []*Record {
			r := mk([]string{"nvidia", "nvidia", "amd", "amd", "amd", "amd"}, nil)
			for _, x := range r {
				x.Mode, x.Simulated, x.GPU = ModeCPU, true, nil
			}
			r[4].SimIsland, r[5].SimIsland = "b", "b"
			return r
		}, KindCPU, map[string][]int{"nvidia": {0, 1}, "amd": {2, 3}, "amd-b": {4, 5}}, []int{0, 2, 4}, BridgeSHM},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sh, problems := Decide("ns", tc.recs())
			require.Empty(t, problems)
			assert.Equal(t, tc.kind, sh.RunKind)
			got := map[string][]int{}
			var leaders []int
			for _, is := range sh.Islands {
				got[is.Label] = is.Ranks
				leaders = append(leaders, is.Leader)
				assert.Equal(t, is.Ranks[0], is.Leader, "leader is the lowest rank")
			}
			assert.Equal(t, tc.islands, got)
			assert.Equal(t, tc.leaders, leaders)
			assert.Equal(t, tc.leaders, sh.Bridge.Members)
			assert.Equal(t, tc.transport, sh.Bridge.Transport)
			for _, ri := range sh.Ranks {
				wantRole := RoleMember
				for _, l := range leaders {
					if l == ri.Rank {
						wantRole = RoleLeader
					}
				}
				assert.Equal(t, wantRole, ri.Role)
			}
			// The same records give the same digest; each rank sees itself.
			sh2, _ := Decide("ns", tc.recs())
			assert.Equal(t, sh.Digest(), sh2.Digest())
			last := len(sh.Ranks) - 1
			assert.Equal(t, last, sh.ForRank(last).Self.Rank)
		})
	}
}

func TestDecideProblems(t *testing.T) {
	tests := []struct {
		name   string
		mutate func([]*Record) []*Record
		want   []string
	}{
		{"rank problem", func(r []*Record) []*Record {
			r[1].Problems = []string{"LOCAL_RANK 5 but only 2 GPUs are visible"}
			return r
		}, []string{"rank 1 (h0): LOCAL_RANK 5 but only 2 GPUs are visible"}},
		{"cpu/gpu mix", func(r []*Record) []*Record {
			r[2].Mode, r[3].Mode = ModeCPU, ModeCPU
			return r
		}, []string{"CPU/GPU mode (a CPU/GPU mix) differs between ranks: cpu on ranks 2,3; gpu on ranks 0,1"}},
		{"bridge requests differ", func(r []*Record) []*Record {
			r[0].Bridge = BridgeTCP
			return r
		}, []string{"the requested bridge differs between ranks: auto on ranks 1,2,3; tcp on ranks 0"}},
		{"settings differ", func(r []*Record) []*Record {
			for _, x := range r {
				x.Settings = map[string]string{"chunk": "4M", "timeout": "60s"}
			}
			r[3].Settings = map[string]string{"chunk": "8M"}
			return r
		}, []string{
			"setting chunk differs between ranks: 4M on ranks 0,1,2; 8M on ranks 3",
			"setting timeout differs between ranks: (unset) on ranks 3; 60s on ranks 0,1,2",
		}},
		{"versions differ", func(r []*Record) []*Record {
			r[1].ToolVersion = "2.0"
			return r
		}, []string{"gpubridge version differs between ranks: 1.0 on ranks 0,2,3; 2.0 on ranks 1"}},
		{"same GPU in island", func(r []*Record) []*Record {
			r[1].GPU = &GPU{UUID: "GPU-0"}
			return r
		}, []string{"ranks 0 and 1 of island nvidia both use GPU GPU-0: NCCL/RCCL need one GPU per rank (check LOCAL_RANK and CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)"}},
		{"same PCI on one host", func(r []*Record) []*Record {
			r[2].GPU = &GPU{PCI: "0000:09:00.0"}
			r[3].GPU = &GPU{PCI: "0000:09:00.0"}
			return r
		}, []string{"ranks 2 and 3 of island amd both use GPU at PCI 0000:09:00.0 on h0: NCCL/RCCL need one GPU per rank (check LOCAL_RANK and CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)"}},
		{"same GPU in two islands is fine for split", func(r []*Record) []*Record {
			for i, x := range r {
				x.Vendor, x.SplitTest = VendorNVIDIA, SplitHalf
				x.GPU = &GPU{UUID: fmt.Sprintf("GPU-%d", i%2)}
			}
			return r
		}, nil},
		{"no vendor", func(r []*Record) []*Record {
			r[2].Vendor = ""
			return r
		}, []string{"rank 2 (h0): no detectable vendor (no GPU found, GPUBRIDGE_VENDOR not set)"}},
		{"world size", func(r []*Record) []*Record {
			r[0].WorldSize = 8
			return r
		}, []string{"rank 0 (h0) was started with world size 8, but 4 ranks reported"}},
		{"split of mixed job", func(r []*Record) []*Record {
			for _, x := range r {
				x.SplitTest = SplitHalf
			}
			return r
		}, []string{"GPUBRIDGE_SPLIT_TEST needs a single-vendor job, but vendors are amd on ranks 2,3; nvidia on ranks 0,1"}},
		{"split node one host", func(r []*Record) []*Record {
			for _, x := range r {
				x.Vendor, x.SplitTest = VendorNVIDIA, SplitNode
			}
			return r
		}, []string{"GPUBRIDGE_SPLIT_TEST=node needs ranks on at least 2 hosts, all 4 ranks are on h0"}},
		{"bad split mode", func(r []*Record) []*Record {
			for _, x := range r {
				x.Vendor, x.SplitTest = VendorNVIDIA, "thirds"
			}
			return r
		}, []string{`GPUBRIDGE_SPLIT_TEST="thirds" is not a split mode (half, alternate, node)`}},
		{"shm across hosts", func(r []*Record) []*Record {
			r[2].Hostname, r[3].Hostname = "h1", "h1"
			for _, x := range r {
				x.Bridge = BridgeSHM
			}
			return r
		}, []string{"bridge shm was requested, but the leaders (ranks 0,2) are on 2 hosts (h0, h1): shared memory needs one host"}},
		{"verbs where a leader's node cannot", func(r []*Record) []*Record {
			r[2].Hostname, r[3].Hostname = "h1", "h1"
			for _, x := range r {
				x.Bridge = BridgeVerbs
				x.Probe.Verbs, x.Probe.VerbsPorts = "ok", []VerbsPort{{Device: "mlx5_0", Port: 1, LinkLayer: "InfiniBand"}}
			}
			r[2].Probe.Verbs, r[2].Probe.VerbsError, r[2].Probe.VerbsPorts = "unavailable", "libibverbs.so.1: not found", nil
			return r
		}, []string{"bridge verbs was requested, but rank 2 on h1 has no active RDMA port that libibverbs opens (libibverbs unavailable: libibverbs.so.1: not found)"}},
		{"several problems listed together", func(r []*Record) []*Record {
			r[0].Problems = []string{"probe failed"}
			r[3].Problems = []string{"no GPU"}
			r[1].Bridge = BridgeTCP
			return r
		}, []string{
			"rank 0 (h0): probe failed", "rank 3 (h0): no GPU",
			"the requested bridge differs between ranks: auto on ranks 2; tcp on ranks 1",
		}},
		{"an incomplete record is not compared", func(r []*Record) []*Record {
			r[2].Problems = []string{"probe report is not JSON"}
			r[2].Simulated, r[2].Mode, r[2].Bridge = true, ModeCPU, ""
			return r
		}, []string{"rank 2 (h0): probe report is not JSON"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			recs := tc.mutate(mk([]string{"nvidia", "nvidia", "amd", "amd"}, nil))
			sh, problems := Decide("ns", recs)
			assert.Equal(t, tc.want, problems)
			if tc.want != nil {
				assert.Nil(t, sh)
			} else {
				assert.NotNil(t, sh)
			}
		})
	}
}

func TestDecodeRecord(t *testing.T) {
	r := mk(nv(2), nil)[1]
	b, err := r.Encode()
	require.NoError(t, err)
	got, err := DecodeRecord(1, b)
	require.NoError(t, err)
	assert.Equal(t, r, got)

	_, err = DecodeRecord(0, b)
	assert.ErrorContains(t, err, "record stored for rank 0 names rank 1")
	for _, tt := range []struct{ in, want string }{
		{"{", "record of rank 1 is not JSON: unexpected end of JSON input"},
		{"[1,2]", "record of rank 1 is a JSON array, want an object"},
		{`"text"`, "record of rank 1 is a JSON string, want an object"},
		{`{"schema":"gpubridge.record/v1","rank":"1"}`, `record of rank 1 is JSON of the wrong shape: field "rank" is a JSON string, want an integer`},
		{`{"schema":"gpubridge.record/v1","rank":1,"problems":"x"}`, `record of rank 1 is JSON of the wrong shape: field "problems" is a JSON string, want an array`},
		{`{"schema":"gpubridge.record/v1","rank":1,"gpu":{"index":true}}`, `record of rank 1 is JSON of the wrong shape: field "gpu.index" is a JSON bool, want an integer`},
	} {
		_, err = DecodeRecord(1, []byte(tt.in))
		assert.EqualError(t, err, tt.want, tt.in)
	}
	_, err = DecodeRecord(1, []byte(`{"schema":"gpubridge.record/v0","rank":1}`))
	assert.ErrorContains(t, err, `has schema "gpubridge.record/v0"`)
	_, err = DecodeRecord(1, make([]byte, MaxRecordBytes+1))
	assert.ErrorContains(t, err, "over the")
}

func FuzzDecodeRecord(f *testing.F) {
	b, _ := mk(nv(1), nil)[0].Encode()
	f.Add(b)
	f.Add([]byte(`{"schema":"gpubridge.record/v1","rank":0,"gpu":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := DecodeRecord(0, data)
		if err == nil {
			// A decoded record always re-encodes.
			_, err := r.Encode()
			require.NoError(t, err)
		}
	})
}

func FuzzReadProbe(f *testing.F) {
	f.Add([]byte(`{"schema":"gpubridge.probe/v1","hostname":"h","vendor":"nvidia","gpus":[{"vendor":"nvidia","index":0,"uuid":"GPU-1"}]}`))
	f.Add([]byte(`{"schema":"gpubridge.probe/v0"}`))
	f.Add([]byte(``))
	f.Fuzz(func(t *testing.T, data []byte) {
		rep, err := ReadProbe(bytes.NewReader(data))
		if err == nil {
			require.NotNil(t, rep)
			// A record can always be built from what parses.
			rec := BuildRecord(RecordOptions{Rank: 0, WorldSize: 1, LocalRank: 0, Bridge: BridgeAuto,
				Getenv: func(string) string { return "" }}, bytes.NewReader(data))
			_, err := rec.Encode()
			require.NoError(t, err)
		}
	})
}
