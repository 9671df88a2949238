package trace

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzDecodeLines: any bytes are records or an error, never a panic; what
// is accepted writes out and reads back to the same records.
func FuzzDecodeLines(f *testing.F) {
	for _, name := range []string{"testdata/trace/rank-0.jsonl", "testdata/dumps/rank-1.dump.jsonl"} {
		if b, err := readFile(name); err == nil {
			f.Add(b[:min(len(b), 4096)])
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		srcs, err := NewReader(Limits{MaxLine: 1 << 16, MaxRecords: 10000}).DecodeLines(bytes.NewReader(b), "fuzz")
		if err != nil {
			return
		}
		var out bytes.Buffer
		if err := WriteSources(&out, srcs); err != nil {
			t.Fatal(err)
		}
		again, err := NewReader(Limits{}).DecodeLines(&out, "again")
		if err != nil {
			t.Fatalf("written records do not read back: %v\n%s", err, out.String())
		}
		if len(again) != len(srcs) {
			t.Fatalf("%d sources, then %d", len(srcs), len(again))
		}
		for i := range srcs {
			a, _ := json.Marshal(srcs[i].Collectives)
			b, _ := json.Marshal(again[i].Collectives)
			if !bytes.Equal(a, b) {
				t.Fatalf("source %d changed:\n%s\n%s", i, a, b)
			}
		}
		_ = Hang(srcs, HangOptions{})
		m := Merge(srcs)
		_ = Summarize(m.Collectives)
		_, _ = Stragglers(m.Collectives, nil, StragglerOptions{Window: 2}, true)
		var steps []Step
		classes := map[int]string{}
		for _, s := range srcs {
			steps = append(steps, s.Steps...)
			if s.Header.Hardware != nil {
				classes[s.Rank()] = s.Header.Hardware.Class
			}
		}
		_, _ = Hetero(HeteroInput{Splits: SplitSteps(m.Collectives, steps), Classes: classes}, HeteroOptions{Window: 2})
		_ = Perfetto(&out, srcs)
	})
}

// FuzzUnpickle: the restricted unpickler never panics and stays within its
// budget.
func FuzzUnpickle(f *testing.F) {
	if b, err := readFile("testdata/torch-fr-pickle/frp_0.pkl"); err == nil {
		f.Add(b)
	}
	f.Add([]byte("\x80\x04]q\x00.")) // []
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = Unpickle(b)
	})
}

// FuzzFR: any JSON document (or pickle) as a torch dump is a source or an
// error.
func FuzzFR(f *testing.F) {
	if b, err := readFile("testdata/torch-fr/fr_0.json"); err == nil {
		f.Add(b)
	}
	f.Add([]byte(`{"entries":[{"collective_seq_id":1,"input_sizes":[[1e30,1e30]],"input_dtypes":["Float"],"process_group":["0",""]}],"pg_config":{"0":{"ranks":"[0, 1]"}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		srcs, err := NewReader(Limits{MaxFile: 1 << 20}).LoadRank(nil, bytes.NewReader(b), 1)
		if err != nil {
			return
		}
		_ = Hang(srcs, HangOptions{})
		_ = Summarize(Merge(srcs).Collectives)
	})
}
