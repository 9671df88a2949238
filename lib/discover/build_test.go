package discover

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const simProbe = `{"schema":"gpubridge.probe/v1","hostname":"h1","vendor":"amd","simulated":true,"real_vendor":"none"}`

// TestBuildRecordCallerProblems: the problems a caller passes (gbdiscover
// --problem) go first into the rank's record, next to what the record finds
// itself, and Decide names the rank with each of them on every rank.
func TestBuildRecordCallerProblems(t *testing.T) {
	tests := []struct {
		name     string
		probe    string
		problems []string
		want     []string
		vendor   string
	}{
		{"none", simProbe, nil, nil, VendorAMD},
		{"one", simProbe, []string{"LOCAL_RANK='x' is not an integer"},
			[]string{"LOCAL_RANK='x' is not an integer"}, VendorAMD},
		{"several, blanks dropped", simProbe, []string{"the tool gbbridge was not found", "  ", "b, with a comma"},
			[]string{"the tool gbbridge was not found", "b, with a comma"}, VendorAMD},
		{"no probe input", "", []string{"the tool gbprobe was not found"},
			[]string{"the tool gbprobe was not found", "probe report is empty (did gbprobe --json run?)"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := RecordOptions{Rank: 1, WorldSize: 2, LocalRank: -1, Bridge: BridgeAuto, Problems: tt.problems,
				Getenv: func(string) string { return "" }}
			rec := BuildRecord(o, strings.NewReader(tt.probe))
			assert.Equal(t, tt.want, rec.Problems)
			assert.Equal(t, tt.vendor, rec.Vendor)

			// A healthy rank 0 next to it: the verdict names rank 1's problems.
			r0 := BuildRecord(RecordOptions{Rank: 0, WorldSize: 2, LocalRank: 0, Bridge: BridgeAuto,
				Getenv: func(string) string { return "" }}, strings.NewReader(simProbe))
			require.Empty(t, r0.Problems)
			_, problems := Decide("ns", []*Record{r0, rec})
			if len(tt.want) == 0 {
				assert.Empty(t, problems)
				return
			}
			want := make([]string, len(tt.want))
			for i, p := range tt.want {
				want[i] = "rank 1 (" + rec.Hostname + "): " + p
			}
			assert.Equal(t, want, problems)
		})
	}
}

// TestBuildRecordSimIsland: a simulated rank takes the island name it asks
// for; a bad name is the rank's problem; on GPUs the option is ignored.
func TestBuildRecordSimIsland(t *testing.T) {
	tests := []struct {
		name, probe, island, want string
		problem                   bool
	}{
		{"simulated", simProbe, "b", "b", false},
		{"bad name", simProbe, "B/x", "", true},
		{"too long", simProbe, strings.Repeat("a", 33), "", true},
		{"ignored on GPUs", `{"schema":"gpubridge.probe/v1","hostname":"h1","vendor":"nvidia","real_vendor":"nvidia"}`, "b", "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := BuildRecord(RecordOptions{Rank: 0, WorldSize: 1, LocalRank: -1, Bridge: BridgeAuto, SimIsland: tt.island,
				Getenv: func(string) string { return "" }}, strings.NewReader(tt.probe))
			assert.Equal(t, tt.want, rec.SimIsland)
			found := false
			for _, p := range rec.Problems {
				found = found || strings.Contains(p, "GPUBRIDGE_SIM_ISLAND")
			}
			assert.Equal(t, tt.problem, found, rec.Problems)
		})
	}
}

// TestReadProbeShapes: valid JSON of the wrong shape says what shape was
// expected instead of "is not JSON" (issue 9).
func TestReadProbeShapes(t *testing.T) {
	const want = ` (want gbprobe --json output, an object with schema "gpubridge.probe/v1")`
	tests := []struct{ in, err string }{
		{"{", "probe report is not JSON: unexpected end of JSON input" + want},
		{"[1, 2]", "probe report is a JSON array, want an object" + want},
		{`"gbprobe"`, "probe report is a JSON string, want an object" + want},
		{`{"schema": "gpubridge.probe/v1", "gpus": "none"}`, `probe report is JSON of the wrong shape: field "gpus" is a JSON string, want an array` + want},
		{`{"schema": "gpubridge.probe/v1", "hostname": 5}`, `field "hostname" is a JSON number, want a string`},
		{`null`, `probe report has no schema field` + want},
		{`{"hostname": "h"}`, `probe report has no schema field` + want},
		{`{"schema": "other/v1"}`, `probe report has schema "other/v1", want "gpubridge.probe/v1"`},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			_, err := ReadProbe(strings.NewReader(tt.in))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.err)
		})
	}
}

// TestBuildRecordVerbsPorts: the record carries the RDMA ports the verbs
// bridge could use (active in sysfs, opened by libibverbs, active there),
// and libibverbs' state when it had none to give.
func TestBuildRecordVerbsPorts(t *testing.T) {
	const withVerbs = `{"schema":"gpubridge.probe/v1","hostname":"h1","vendor":"amd","simulated":true,"real_vendor":"none",
	"verbs":{"state":"ok"},"rdma":[
	 {"name":"rxe0","verbs":{"opened":true},"ports":[{"port":1,"state":"ACTIVE","link_layer":"Ethernet","verbs_state":"ACTIVE"}]},
	 {"name":"mlx5_0","verbs":{"opened":false,"error":"no provider"},"ports":[{"port":1,"state":"ACTIVE","link_layer":"InfiniBand"}]},
	 {"name":"mlx5_1","verbs":{"opened":true},"ports":[{"port":1,"state":"DOWN","link_layer":"InfiniBand","verbs_state":"DOWN"}]}]}`
	const noVerbs = `{"schema":"gpubridge.probe/v1","hostname":"h1","vendor":"amd","simulated":true,"real_vendor":"none",
	"verbs":{"state":"unavailable","error":"libibverbs.so.1: not found"},"rdma":[
	 {"name":"mlx5_0","ports":[{"port":1,"state":"ACTIVE","link_layer":"InfiniBand"}]}]}`
	o := RecordOptions{Rank: 1, WorldSize: 2, LocalRank: -1, Bridge: BridgeAuto, Getenv: func(string) string { return "" }}
	rec := BuildRecord(o, strings.NewReader(withVerbs))
	assert.Equal(t, "ok", rec.Probe.Verbs)
	assert.Equal(t, 2, rec.Probe.RDMA, "active ports in sysfs")
	assert.Equal(t, []VerbsPort{{Device: "rxe0", Port: 1, LinkLayer: "Ethernet"}}, rec.Probe.VerbsPorts)
	rec = BuildRecord(o, strings.NewReader(noVerbs))
	assert.Equal(t, "unavailable", rec.Probe.Verbs)
	assert.Equal(t, "libibverbs.so.1: not found", rec.Probe.VerbsError)
	assert.Empty(t, rec.Probe.VerbsPorts)
	assert.Equal(t, 1, rec.Probe.RDMA)
}
