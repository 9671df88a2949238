package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite testdata/golden")

// golden compares got with testdata/golden/name (rewritten with -update).
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	p := filepath.Join("testdata", "golden", name)
	if *update {
		require.NoError(t, os.WriteFile(p, got, 0o644))
	}
	want, err := os.ReadFile(p)
	require.NoError(t, err, "run go test ./lib/trace -update")
	assert.Equal(t, string(want), string(got), "testdata/golden/%s differs (go test ./lib/trace -update rewrites it)", name)
}

func jsonLines[T any](t *testing.T, vals []T) []byte {
	t.Helper()
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	for _, v := range vals {
		require.NoError(t, enc.Encode(v))
	}
	return b.Bytes()
}

func load(t *testing.T, paths ...string) []*Source {
	t.Helper()
	srcs, err := NewReader(Limits{}).Load(paths, nil)
	require.NoError(t, err)
	return srcs
}

// The traces in testdata/trace are a real 4-rank job (2 simulated NVIDIA +
// 2 AMD ranks, DDP through the backend, 30 steps: make demo's job, shorter).
func TestGoldenTrace(t *testing.T) {
	srcs := load(t, "testdata/trace")
	require.Len(t, srcs, 4)
	for r, s := range srcs {
		assert.Equal(t, r, s.Rank())
		assert.Equal(t, "trace", s.Format)
		assert.Len(t, s.Collectives, 39)
	}
	m := Merge(srcs)
	assert.Empty(t, m.Warnings)
	for _, c := range m.Collectives {
		assert.True(t, c.Complete, "#%d", c.Seq)
		assert.Equal(t, 4, c.Seen)
		assert.Empty(t, c.Mismatches)
	}
	golden(t, "trace.merge.jsonl", jsonLines(t, m.Collectives))
	golden(t, "trace.summary.jsonl", jsonLines(t, Summarize(m.Collectives)))
	golden(t, "trace.hang.jsonl", jsonLines(t, Hang(srcs, HangOptions{})))
	flags, sum := Stragglers(m.Collectives, nil, StragglerOptions{Window: 10}, true)
	golden(t, "trace.stragglers.jsonl", append(jsonLines(t, flags), jsonLines(t, []StragglerSummary{sum})...))
	var b bytes.Buffer
	require.NoError(t, Perfetto(&b, srcs))
	golden(t, "trace.perfetto.json", b.Bytes())
}

// testdata/dumps: the dumps ranks 0-2 wrote when rank 3 was SIGSTOPped
// before its 6th all_reduce (torchplugin/tests/test_trace.py).
func TestHangFromDumps(t *testing.T) {
	reps := Hang(load(t, "testdata/dumps"), HangOptions{})
	require.Len(t, reps, 1)
	r := reps[0]
	assert.Equal(t, "failed", r.Status)
	assert.Equal(t, []int{3}, r.NeverArrived)
	assert.Equal(t, []int{3}, r.NoDump)
	assert.Equal(t, []int{0, 1, 2}, r.Arrived)
	assert.EqualValues(t, 5, r.AllCompleted)
	assert.EqualValues(t, 6, r.FirstIncomplete)
	assert.Equal(t, "all_reduce", r.Op)
	assert.Contains(t, r.Verdict, "rank(s) 3 never arrived at all_reduce #6 (all completed #5); no dump from rank(s) 3")
	golden(t, "dumps.hang.jsonl", jsonLines(t, reps))
}

// testdata/torch-fr and torch-fr-pickle: one real Gloo job's dumps
// (TORCH_FR_BUFFER_SIZE=100, torch 2.11), as JSON and as pickle.
func TestTorchFlightRecorder(t *testing.T) {
	js := load(t, "testdata/torch-fr")
	pk := load(t, "testdata/torch-fr-pickle")
	require.Len(t, js, 2)
	require.Len(t, pk, 2)
	for i := range js {
		assert.Equal(t, "torch-fr", js[i].Format)
		assert.Equal(t, i, js[i].Rank())
		// The pickle says the same as the JSON, but for the stack frames.
		assert.Equal(t, js[i].Collectives, pk[i].Collectives)
		assert.Equal(t, js[i].Header.Groups, pk[i].Header.Groups)
	}
	c := js[0].Collectives
	require.Len(t, c, 6)
	ops := []string{}
	for i, x := range c {
		ops = append(ops, x.Op)
		assert.Equal(t, "float32", *x.DType)
		// Gloo's recorder marks completions late (pg_status said 5 of 6
		// after the last one's wait() had returned): the last is in flight.
		if i < 5 {
			assert.Equal(t, ResultOK, x.Result)
		} else {
			assert.Equal(t, ResultInFlight, x.Result)
		}
	}
	assert.Equal(t, []string{"all_reduce", "all_reduce", "all_reduce", "broadcast", "all_gather", "all_reduce"}, ops)
	assert.EqualValues(t, 4000, c[0].Bytes)
	assert.EqualValues(t, 8000, c[4].Bytes) // all_gather: the output
	var b bytes.Buffer
	require.NoError(t, WriteSources(&b, js))
	golden(t, "torch-fr.records.jsonl", b.Bytes())
	again, err := NewReader(Limits{}).DecodeLines(&b, "stdin")
	require.NoError(t, err)
	assert.Equal(t, js[1].Collectives, again[1].Collectives)
	h := Hang(js, HangOptions{})[0]
	assert.Equal(t, "hang", h.Status)
	assert.Equal(t, []int{0, 1}, h.Arrived)
	assert.Empty(t, h.NeverArrived)
}

func TestDecodeErrors(t *testing.T) {
	head := `{"schema":"gpubridge.trace/v1","kind":"rank","rank":1,"clock":{"offset_ns":0,"error_ns":0,"ref":0,"method":"same boot"}}` + "\n"
	coll := func(extra string) string {
		return `{"schema":"gpubridge.trace/v1","kind":"collective","rank":1,"group":{"name":"0","rank":1,"size":2},"seq":1,"op":"all_reduce","bytes":4,"arrived":5,"phases":[],"result":"ok"` + extra + "}\n"
	}
	tests := []struct {
		name, in, want string
	}{
		{"empty", "", "stdin: no records"},
		{"not json", head + "{nope\n", "stdin:2: not a JSON object"},
		{"schema", `{"schema":"gpubridge.trace/v9","kind":"rank"}`, "stdin:1: schema \"gpubridge.trace/v9\""},
		{"no header", coll(""), "stdin:1: a \"collective\" record before any rank or dump record"},
		{"other rank", head + strings.Replace(coll(""), `"rank":1,"group"`, `"rank":2,"group"`, 1), "stdin:2: collective record of rank 2 in rank 1's records"},
		{"result", head + coll(`,"result":"maybe"`), "stdin:2: collective record #1: result \"maybe\""},
		{"group rank", head + strings.Replace(coll(""), `"rank":1,"size":2`, `"rank":2,"size":2`, 1), "group rank 2 of size 2"},
		{"group record", head + `{"schema":"gpubridge.trace/v1","kind":"group","name":"0","size":3,"ranks":[0,1]}` + "\n", "2 ranks for size 3"},
		{"long line", head + `{"schema":"gpubridge.trace/v1","kind":"x","pad":"` + strings.Repeat("a", 300) + "\"}\n", "stdin:2: a line longer than 200 bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewReader(Limits{MaxLine: 200}).DecodeLines(strings.NewReader(tc.in), "stdin")
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
			var de *DecodeError
			assert.True(t, errors.As(err, &de))
		})
	}
	// Kinds of a later version are skipped; several sources in one stream.
	srcs, err := NewReader(Limits{}).DecodeLines(strings.NewReader(head+`{"schema":"gpubridge.trace/v1","kind":"future"}`+"\n"+coll("")+strings.Replace(head, `"rank":1`, `"rank":0`, 1)), "stdin")
	require.NoError(t, err)
	require.Len(t, srcs, 2)
	assert.Equal(t, 1, srcs[0].Skipped)
	assert.Len(t, srcs[0].Collectives, 1)
	// The record budget.
	_, err = NewReader(Limits{MaxRecords: 2}).DecodeLines(strings.NewReader(head+coll("")+coll("")), "stdin")
	assert.ErrorIs(t, err, ErrLimit)
}

func TestFRErrors(t *testing.T) {
	_, err := NewReader(Limits{}).LoadRank(nil, strings.NewReader(`{"entries": []}`), -1)
	assert.ErrorContains(t, err, "does not say its rank")
	srcs, err := NewReader(Limits{}).LoadRank(nil, strings.NewReader(`{"entries": [], "version": "2.10"}`), 3)
	require.NoError(t, err)
	assert.Equal(t, 3, srcs[0].Rank())
	_, err = NewReader(Limits{}).LoadRank(nil, strings.NewReader(`{"entries": 7}`), 0)
	assert.ErrorContains(t, err, "entries is not a list")
	_, err = NewReader(Limits{MaxFile: 10}).LoadRank(nil, strings.NewReader(`{"entries": [], "padding": "0123456789"}`), 0)
	assert.ErrorIs(t, err, ErrLimit)
	assert.Equal(t, 3, rankFromName("/tmp/nccl_trace_rank_3"))
	assert.Equal(t, 12, rankFromName("fr_12.json"))
	assert.Equal(t, -1, rankFromName("dump.json"))
}

func TestUnpickle(t *testing.T) {
	// pickle.dumps({"a": [1, -2, 300, 70000, 2**40, True, None, 1.5, "é", (1, 2)], "a2": b"x"}, protocol=4), then memo reuse
	b := []byte("\x80\x04\x95P\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01J\x70\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\x01\x88NG?\xf8\x00\x00\x00\x00\x00\x00\x8c\x02\xc3\xa9\x94K\x01K\x02\x86\x94e\x8c\x02a2\x94C\x01x\x94u.")
	v, err := Unpickle(b)
	require.NoError(t, err)
	m := v.(map[string]any)
	assert.Equal(t, []any{int64(1), int64(-2), int64(300), int64(70000), int64(1 << 40), true, nil, 1.5, "é", []any{int64(1), int64(2)}}, m["a"])
	assert.Equal(t, "x", m["a2"])
	bad := []struct {
		name string
		in   []byte
		want string
	}{
		{"global", []byte("\x80\x04cos\nsystem\n."), "opcode 0x63 is not allowed"},
		{"reduce", []byte("\x80\x04N)R."), "opcode 0x52 is not allowed"},
		{"truncated string", []byte("\x80\x04X\xff\x00\x00\x00ab."), "truncated"},
		{"no stop", []byte("\x80\x04N"), "no STOP"},
		{"underflow", []byte("\x80\x04a."), "stack underflow"},
		{"memo", []byte("\x80\x04h\x05."), "memo 5 was never stored"},
		{"big int", []byte("\x80\x04\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01."), "9 bytes"},
		{"left over", []byte("\x80\x04NN."), "2 values left at STOP"},
		{"deep", append(append([]byte("\x80\x04"), bytes.Repeat([]byte("]"), 70)...), append(bytes.Repeat([]byte("a"), 69), '.')...), "nested deeper than 64"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Unpickle(tc.in)
			assert.ErrorContains(t, err, tc.want)
		})
	}
	// A memo that repeats one list: each use is copied, within a budget.
	bomb := []byte("\x80\x04]q\x00")
	for i := 0; i < 40; i++ {
		bomb = append(bomb, "0h\x00h\x00\x86q\x00"...) // x = (x, x)
	}
	bomb = append(bomb, '.')
	_, err = Unpickle(bomb)
	assert.ErrorIs(t, err, ErrLimit)
}

func TestMergeAlignsClocks(t *testing.T) {
	off := int64(1000)
	mk := func(rank int, offset int64, arrived int64) *Source {
		end := arrived + 50
		return &Source{Header: Header{Rank: rank, Clock: Clock{OffsetNs: &offset, ErrorNs: ptr(7), Boot: "b" + itoa(int64(rank))}},
			Collectives: []Collective{{Rank: rank, Group: GroupRef{Name: "0", Rank: rank, Size: 2}, Seq: 1, Op: "all_reduce", Bytes: 8,
				Arrived: arrived, End: &end, Result: ResultOK}}}
	}
	m := Merge([]*Source{mk(0, 0, 100), mk(1, off, 1120)})
	require.Len(t, m.Collectives, 1)
	c := m.Collectives[0]
	assert.EqualValues(t, 100, c.FirstArrival)
	assert.EqualValues(t, 120, c.LastArrival)
	assert.Equal(t, 1, c.LastRank)
	assert.EqualValues(t, 20, c.SkewNs)
	assert.EqualValues(t, 50, *c.TimeNs)
	assert.EqualValues(t, 7, *c.AlignErrorNs)
	assert.EqualValues(t, []int64{20, 0}, []int64{c.Ranks[0].WaitNs, c.Ranks[1].WaitNs})
	// Unmeasured offsets on two boots: a warning, no alignment error bound.
	u := Merge([]*Source{{Header: Header{Rank: 0, Clock: Clock{Boot: "a"}}}, {Header: Header{Rank: 1, Clock: Clock{Boot: "b"}}}})
	assert.Len(t, u.Warnings, 1)
}

func TestHangMismatchAndOrder(t *testing.T) {
	f32 := "float32"
	src := func(rank int, ops ...string) *Source {
		s := &Source{Header: Header{Rank: rank, Kind: KindDump}, Groups: map[string]Group{"0": {Name: "0", Size: 3, Ranks: []int{0, 1, 2}}}}
		for i, op := range ops {
			end := int64(i + 1)
			s.Collectives = append(s.Collectives, Collective{Rank: rank, Group: GroupRef{Name: "0", Rank: rank, Size: 3}, Seq: int64(i + 1),
				Op: op, Bytes: 4, DType: &f32, Arrived: int64(i), End: &end, Result: ResultOK})
		}
		last := &s.Collectives[len(s.Collectives)-1]
		last.Result, last.End = ResultInFlight, nil
		return s
	}
	reps := Hang([]*Source{src(0, "all_reduce", "broadcast", "all_gather", "all_reduce"), src(1, "all_reduce", "broadcast", "all_gather", "all_reduce"),
		src(2, "all_reduce", "all_gather", "all_reduce")}, HangOptions{})
	require.Len(t, reps, 1)
	r := reps[0]
	assert.Equal(t, "mismatch", r.Status)
	require.NotEmpty(t, r.Mismatches)
	assert.Equal(t, "order", r.Mismatches[0].Field)
	assert.EqualValues(t, 2, r.Mismatches[0].Seq)
	assert.Contains(t, r.Mismatches[0].Text, "rank(s) 2 are one collective ahead of rank(s) 0, 1 from here (they skipped broadcast #2")
}

func TestSummaryDefinitions(t *testing.T) {
	assert.InDelta(t, 1.5, BusFactor("all_reduce", 4), 1e-12)
	assert.InDelta(t, 0.75, BusFactor("all_gather", 4), 1e-12)
	assert.InDelta(t, 0.75, BusFactor("reduce_scatter", 4), 1e-12)
	assert.InDelta(t, 1, BusFactor("broadcast", 4), 1e-12)
	assert.InDelta(t, 0, BusFactor("barrier", 4), 1e-12)
	assert.EqualValues(t, 1, Bucket(0))
	assert.EqualValues(t, 4096, Bucket(4096))
	assert.EqualValues(t, 8192, Bucket(4097))
	assert.Equal(t, "64M", Human(64<<20))
	assert.Equal(t, "3000", Human(3000))
	// 1 GB moved in 1 s among 4 ranks: algbw 1 GB/s, busbw 1.5 GB/s.
	tn, end := int64(1e9), int64(2e9)
	m := []Merged{{Op: "all_reduce", Size: 4, Seen: 4, Bytes: 1e9, TimeNs: &tn, SkewNs: 0,
		Ranks: []RankView{{Rank: 0, Arrived: 1e9, End: &end, Result: ResultOK, Phases: []Phase{{Name: "bridge", Start: 1e9, End: &end}}}}}}
	rows := Summarize(m)
	require.Len(t, rows, 1)
	assert.InDelta(t, 1.0, rows[0].AlgBW, 1e-9)
	assert.InDelta(t, 1.5, rows[0].BusBW, 1e-9)
	assert.InDelta(t, 1.0, rows[0].Phases["bridge"], 1e-9)
}

func readFile(name string) ([]byte, error) { return os.ReadFile(name) }
