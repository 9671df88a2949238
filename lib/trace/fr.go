package trace

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// torch's Flight Recorder dumps (TORCH_NCCL_TRACE_BUFFER_SIZE or
// TORCH_FR_BUFFER_SIZE; written on a timeout with TORCH_NCCL_DUMP_ON_TIMEOUT
// to TORCH_FR_DUMP_TEMP_FILE<rank>, as a pickle, or returned by
// torch._C._distributed_c10d._dump_fr_trace_json / _dump_nccl_trace_json
// as JSON) become sources of the same records, so that hang, summary and
// perfetto read plain NCCL and Gloo jobs too. A dump does not say its rank:
// it is the number at the end of the file's name (as torch's fr_trace reads
// it), or --rank.

// FRMethod is the clock method of converted dumps: torch stamps entries with
// the wall clock, which no offset aligns.
const FRMethod = "wall clock (torch Flight Recorder; not aligned)"

var trailingNumber = regexp.MustCompile(`(\d+)(\.[A-Za-z]+)*$`)

// rankFromName is the number at the end of a file's base name
// (nccl_trace_rank_3, fr_3.json), or -1.
func rankFromName(path string) int {
	m := trailingNumber.FindStringSubmatch(filepath.Base(path))
	if m == nil {
		return -1
	}
	n, err := strconv.Atoi(m[1])
	if err != nil {
		return -1
	}
	return n
}

func (rd *Reader) decodeFR(br *bufio.Reader, name string, rank int, pickled bool) ([]*Source, error) {
	b, err := io.ReadAll(io.LimitReader(br, rd.Limits.MaxFile+1))
	if err != nil {
		return nil, &DecodeError{name, 0, err}
	}
	if int64(len(b)) > rd.Limits.MaxFile {
		return nil, &DecodeError{name, 0, fmt.Errorf("a torch Flight Recorder dump larger than %d bytes: %w", rd.Limits.MaxFile, ErrLimit)}
	}
	var doc any
	if pickled {
		doc, err = Unpickle(b)
	} else {
		d := json.NewDecoder(strings.NewReader(string(b)))
		d.UseNumber()
		err = d.Decode(&doc)
	}
	if err != nil {
		return nil, &DecodeError{name, 0, fmt.Errorf("torch Flight Recorder dump: %w", err)}
	}
	if rank < 0 {
		return nil, &DecodeError{name, 0, errors.New("a torch Flight Recorder dump does not say its rank and the name ends in no number (give --rank)")}
	}
	src, err := FromFR(doc, rank, name)
	if err != nil {
		return nil, &DecodeError{name, 0, err}
	}
	if err := rd.take(len(src.Collectives)); err != nil {
		return nil, &DecodeError{name, 0, err}
	}
	return []*Source{src}, nil
}

// frDTypes: torch's scalar type names as the dumps write them.
var frDTypes = map[string]string{
	"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
	"Int": "int32", "Long": "int64", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
	"Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
}

var frSizes = map[string]int64{
	"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int16": 2,
	"int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

// frOp is the collective of a profiling name ("nccl:all_reduce").
func frOp(name string) string {
	if i := strings.IndexByte(name, ':'); i >= 0 {
		name = name[i+1:]
	}
	switch name {
	case "all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced":
		return "all_reduce"
	case "all_reduce_barrier", "barrier":
		return "barrier"
	case "all_gather", "allgather", "_allgather_base", "all_gather_into_tensor_coalesced", "allgather_into_tensor_coalesced", "allgather_coalesced":
		return "all_gather"
	case "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_base":
		return "reduce_scatter"
	case "alltoall", "alltoall_base", "all_to_all":
		return "all_to_all"
	}
	return name
}

// FromFR converts one decoded dump (the JSON or the unpickled dict).
func FromFR(doc any, rank int, name string) (*Source, error) {
	top, ok := doc.(map[string]any)
	if !ok {
		return nil, errors.New("torch Flight Recorder dump: not a dict")
	}
	entries, ok := top["entries"].([]any)
	if !ok {
		if top["entries"] != nil {
			return nil, errors.New("torch Flight Recorder dump: entries is not a list")
		}
		entries = nil // a dump with no collectives
	}
	version := str(top["version"])
	src := &Source{
		Name: name, Format: "torch-fr", Groups: map[string]Group{},
		Header: Header{Schema: Schema, Kind: KindDump, Rank: rank, Clock: Clock{Method: FRMethod},
			Reason: "torch Flight Recorder dump (version " + version + ")"},
	}
	groups, err := frGroups(top["pg_config"], rank)
	if err != nil {
		return nil, err
	}
	status, _ := top["pg_status"].(map[string]any)
	seen := map[string]bool{}
	for i, e := range entries {
		m, ok := e.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("entry %d is not a dict", i)
		}
		c, err := frCollective(m, rank, groups, status)
		if err != nil {
			return nil, fmt.Errorf("entry %d: %w", i, err)
		}
		if !seen[c.Group.Name] {
			seen[c.Group.Name] = true
			if g, ok := groups[c.Group.Name]; ok {
				src.Groups[c.Group.Name] = g
			}
		}
		src.Collectives = append(src.Collectives, c)
	}
	names := make([]string, 0, len(status))
	for k := range status {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		st, _ := status[k].(map[string]any)
		g := groups[k]
		src.Header.Groups = append(src.Header.Groups, GroupStatus{
			Name: k, Rank: g.Rank, Size: g.Size,
			Submitted: num(st["last_enqueued_collective"]), Completed: num(st["last_completed_collective"]),
		})
	}
	for _, c := range src.Collectives {
		if c.Arrived > src.Header.WallNs {
			src.Header.WallNs, src.Header.MonoNs = c.Arrived, c.Arrived
		}
	}
	return src, nil
}

// frGroups reads pg_config: {name: {desc, ranks: "[0, 1]"}}.
func frGroups(v any, rank int) (map[string]Group, error) {
	out := map[string]Group{}
	m, _ := v.(map[string]any)
	for name, x := range m {
		g, _ := x.(map[string]any)
		var ranks []int
		switch rs := g["ranks"].(type) {
		case string:
			for _, f := range strings.FieldsFunc(rs, func(r rune) bool { return r == '[' || r == ']' || r == ',' || r == ' ' }) {
				n, err := strconv.Atoi(f)
				if err != nil {
					return nil, fmt.Errorf("pg_config %q: ranks %q", name, rs)
				}
				ranks = append(ranks, n)
			}
		case []any:
			for _, r := range rs {
				ranks = append(ranks, int(num(r)))
			}
		}
		grank := -1
		for i, r := range ranks {
			if r == rank {
				grank = i
			}
		}
		out[name] = Group{Name: name, Rank: grank, Size: len(ranks), Ranks: ranks, Device: "torch"}
	}
	return out, nil
}

func frCollective(m map[string]any, rank int, groups map[string]Group, status map[string]any) (Collective, error) {
	pg, _ := m["process_group"].([]any)
	gname := ""
	if len(pg) > 0 {
		gname = str(pg[0])
	}
	g, ok := groups[gname]
	if !ok && len(groups) == 1 { // Gloo's dumps name their only group "" in pg_config
		for _, only := range groups {
			g = only
		}
		g.Name = gname
		groups[gname] = g
	}
	if g.Size < 1 {
		g = Group{Name: gname, Rank: 0, Size: 1, Ranks: []int{rank}}
	}
	grank := g.Rank
	if grank < 0 {
		grank = 0
	}
	op := frOp(str(m["profiling_name"]))
	c := Collective{
		Rank: rank, Group: GroupRef{Name: gname, Rank: grank, Size: g.Size},
		Seq: num(m["collective_seq_id"]), Op: op, Call: str(m["profiling_name"]),
		Device: "torch", Thread: str(m["thread_name"]), Policy: "native",
	}
	if b, _ := m["is_p2p"].(bool); b {
		c.Seq = num(m["p2p_seq_id"])
		c.Group.Name = gname + "/p2p"
	}
	dts, _ := m["input_dtypes"].([]any)
	if len(dts) == 0 {
		dts, _ = m["output_dtypes"].([]any)
	}
	var esize int64
	if len(dts) > 0 {
		d := str(dts[0])
		if t, ok := frDTypes[d]; ok {
			d = t
		}
		c.DType = &d
		esize = frSizes[d]
	}
	c.Bytes = max(numel(m["input_sizes"]), numel(m["output_sizes"])) * esize
	c.Arrived = num(m["time_created_ns"])
	created := c.Arrived
	if s := num(m["time_discovered_started_ns"]); s > 0 {
		c.Start = &s
		c.Phases = append(c.Phases, Phase{Name: "queued", Start: created, End: ptr(s)})
		created = s
	}
	state := str(m["state"])
	if e := num(m["time_discovered_completed_ns"]); e > 0 {
		c.End = &e
	} else if d, ok := m["duration_ms"]; ok && d != nil && c.Start != nil {
		e := *c.Start + int64(numf(d)*1e6)
		c.End = &e
	}
	st, _ := status[gname].(map[string]any)
	switch {
	case state == "completed" || (st != nil && c.Seq <= num(st["last_completed_collective"]) && !strings.HasSuffix(c.Group.Name, "/p2p")):
		c.Result = ResultOK
	default:
		c.Result = ResultInFlight
		c.Step = state
	}
	ph := Phase{Name: "running", Start: created, End: c.End}
	if c.Result == ResultInFlight {
		ph.Name, ph.End = state, nil
	}
	c.Phases = append(c.Phases, ph)
	return c, nil
}

func ptr(v int64) *int64 { return &v }

func str(v any) string {
	switch t := v.(type) {
	case string:
		return t
	case nil:
		return ""
	}
	return fmt.Sprint(v)
}

func num(v any) int64 {
	switch t := v.(type) {
	case int64:
		return t
	case float64:
		return int64(t)
	case json.Number:
		if n, err := t.Int64(); err == nil {
			return n
		}
		f, _ := t.Float64()
		return int64(f)
	case string:
		n, _ := strconv.ParseInt(t, 10, 64)
		return n
	}
	return 0
}

func numf(v any) float64 {
	switch t := v.(type) {
	case int64:
		return float64(t)
	case float64:
		return t
	case json.Number:
		f, _ := t.Float64()
		return f
	}
	return 0
}

// numel sums the elements of a list of shapes ([[2, 1000], [3]]).
func numel(v any) int64 {
	shapes, _ := v.([]any)
	var total int64
	for _, s := range shapes {
		dims, _ := s.([]any)
		n := int64(1)
		for _, d := range dims {
			n *= max(num(d), 0)
			if n > 1<<50 {
				n = 1 << 50
			}
		}
		total += n
		if total > 1<<50 {
			total = 1 << 50
		}
	}
	return total
}
