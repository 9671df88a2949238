package trace

import (
	"fmt"
	"sort"
	"strings"
)

// HangSchema is the schema of gbtrace hang's lines.
const HangSchema = "gpubridge.trace-hang/v1"

// Where is what one rank was doing when it wrote its dump.
type Where struct {
	Rank      int    `json:"rank"`
	Seq       int64  `json:"seq"`
	Op        string `json:"op"`
	State     string `json:"state"` // in flight, error
	Step      string `json:"step,omitempty"`
	StepNs    *int64 `json:"step_ns,omitempty"`
	Error     string `json:"error,omitempty"`
	Submitted int64  `json:"submitted"` // the last seq it called
	Completed int64  `json:"completed"` // the last seq it ended
}

// HangMismatch is a collective the ranks called differently.
type HangMismatch struct {
	Seq    int64            `json:"seq"`
	Field  string           `json:"field"` // op, bytes, dtype, reduce_op, root, order
	Values map[string][]int `json:"values"`
	Text   string           `json:"text"`
}

// HangReport is one group's state from the dumps (or traces) of its ranks.
type HangReport struct {
	Schema          string         `json:"schema"`
	Group           string         `json:"group"`
	Status          string         `json:"status"` // ok, hang, mismatch, failed
	Ranks           []int          `json:"ranks"`
	NoDump          []int          `json:"no_dump"`          // ranks of the group without any record
	AllCompleted    int64          `json:"all_completed"`    // the last seq every rank with records ended
	FirstIncomplete int64          `json:"first_incomplete"` // 0: none
	Op              string         `json:"op,omitempty"`     // of the first incomplete
	Arrived         []int          `json:"arrived"`          // called the first incomplete
	NeverArrived    []int          `json:"never_arrived"`    // did not (or, without a dump, cannot have said so)
	Furthest        int64          `json:"furthest"`         // the last seq any rank called
	FurthestOp      string         `json:"furthest_op,omitempty"`
	Behind          []int          `json:"behind"` // ranks that never called the furthest
	Where           []Where        `json:"where"`
	Mismatches      []HangMismatch `json:"mismatches,omitempty"`
	Verdict         string         `json:"verdict"`
}

// HangOptions: how many mismatches to report at most.
type HangOptions struct {
	MismatchCap int
}

type rankState struct {
	submitted, completed int64
	bySeq                map[int64]Collective
	have                 bool
}

// Hang finds, per group, the last collective every rank completed, the
// first one some rank did not, who never arrived at it, where each rank
// is, and collectives the ranks called differently (as torch's fr_trace
// does). A rank without any dump is named: a stopped or dead process
// cannot write one.
func Hang(srcs []*Source, o HangOptions) []HangReport {
	if o.MismatchCap <= 0 {
		o.MismatchCap = 10
	}
	groups := map[string]map[int]*rankState{}
	members := map[string][]int{}
	state := func(g string, r int) *rankState {
		if groups[g] == nil {
			groups[g] = map[int]*rankState{}
		}
		s := groups[g][r]
		if s == nil {
			s = &rankState{bySeq: map[int64]Collective{}}
			groups[g][r] = s
		}
		return s
	}
	for _, src := range srcs {
		r := src.Rank()
		for name, g := range src.Groups {
			if len(g.Ranks) > len(members[name]) {
				members[name] = g.Ranks
			}
		}
		for _, gs := range src.Header.Groups {
			s := state(gs.Name, r)
			s.have = true
			s.submitted = max(s.submitted, gs.Submitted)
			s.completed = max(s.completed, gs.Completed)
		}
		for _, c := range src.Collectives {
			s := state(c.Group.Name, r)
			s.have = true
			s.submitted = max(s.submitted, c.Seq)
			if c.Result == ResultOK {
				s.completed = max(s.completed, c.Seq)
			}
			if old, ok := s.bySeq[c.Seq]; !ok || old.Result == ResultInFlight {
				s.bySeq[c.Seq] = c
			}
		}
	}
	names := make([]string, 0, len(groups))
	for g := range groups {
		names = append(names, g)
	}
	sort.Strings(names)
	var out []HangReport
	for _, g := range names {
		out = append(out, hangGroup(g, groups[g], members[g], o))
	}
	return out
}

func hangGroup(name string, st map[int]*rankState, ranks []int, o HangOptions) HangReport {
	rep := HangReport{Schema: HangSchema, Group: name, Arrived: []int{}, NeverArrived: []int{}, NoDump: []int{}, Where: []Where{}, Behind: []int{}}
	if ranks == nil {
		size := 0
		for _, s := range st {
			for _, c := range s.bySeq {
				size = max(size, c.Group.Size)
			}
		}
		// Without a group record the global ranks are the group ranks.
		for r := 0; r < size; r++ {
			ranks = append(ranks, r)
		}
		for r := range st {
			if r >= size {
				ranks = append(ranks, r)
			}
		}
		sort.Ints(ranks)
	}
	rep.Ranks = ranks
	first := true
	for _, r := range ranks {
		s := st[r]
		if s == nil || !s.have {
			rep.NoDump = append(rep.NoDump, r)
			continue
		}
		if first || s.completed < rep.AllCompleted {
			rep.AllCompleted = s.completed
		}
		first = false
	}
	// The first incomplete: after the last every rank completed, if any
	// rank got further or is inside it; with ranks missing, it is the one
	// after what the others completed.
	further := len(rep.NoDump) > 0
	for _, s := range st {
		further = further || s.submitted > rep.AllCompleted
	}
	if further {
		rep.FirstIncomplete = rep.AllCompleted + 1
	}
	n := rep.FirstIncomplete
	for _, r := range ranks {
		s := st[r]
		if s == nil || !s.have {
			if n > 0 {
				rep.NeverArrived = append(rep.NeverArrived, r)
			}
			continue
		}
		if n > 0 {
			if s.submitted >= n {
				rep.Arrived = append(rep.Arrived, r)
				if c, ok := s.bySeq[n]; ok && rep.Op == "" {
					rep.Op = c.Op
				}
			} else {
				rep.NeverArrived = append(rep.NeverArrived, r)
			}
		}
		seqs := make([]int64, 0)
		for q, c := range s.bySeq {
			if c.Result != ResultOK {
				seqs = append(seqs, q)
			}
		}
		sort.Slice(seqs, func(i, j int) bool { return seqs[i] < seqs[j] })
		for _, q := range seqs {
			c := s.bySeq[q]
			rep.Where = append(rep.Where, Where{Rank: r, Seq: q, Op: c.Op, State: c.Result, Step: c.Step, StepNs: c.StepNs,
				Error: firstLine(c.Error), Submitted: s.submitted, Completed: s.completed})
		}
		if len(seqs) == 0 && n > 0 {
			rep.Where = append(rep.Where, Where{Rank: r, Seq: s.submitted, State: "idle: nothing in flight", Submitted: s.submitted, Completed: s.completed})
		}
	}
	// The furthest any rank got: with ranks that mark completions late (Gloo's
	// Flight Recorder) the first incomplete may be one every rank is past.
	for _, s := range st {
		rep.Furthest = max(rep.Furthest, s.submitted)
	}
	if rep.Furthest > rep.AllCompleted {
		for _, r := range ranks {
			s := st[r]
			if s == nil || !s.have || s.submitted < rep.Furthest {
				rep.Behind = append(rep.Behind, r)
			} else if c, ok := s.bySeq[rep.Furthest]; ok && rep.FurthestOp == "" {
				rep.FurthestOp = c.Op
			}
		}
	}
	rep.Mismatches = hangMismatches(st, ranks, o.MismatchCap)
	failed := false
	for _, w := range rep.Where {
		failed = failed || w.State == ResultError
	}
	switch {
	case len(rep.Mismatches) > 0:
		rep.Status = "mismatch"
	case n > 0 && failed:
		rep.Status = "failed"
	case n > 0:
		rep.Status = "hang"
	default:
		rep.Status = "ok"
	}
	rep.Verdict = hangVerdict(&rep)
	return rep
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func joinRanks(rs []int) string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = fmt.Sprint(r)
	}
	return strings.Join(parts, ", ")
}

func hangVerdict(r *HangReport) string {
	if r.FirstIncomplete == 0 && len(r.Mismatches) == 0 {
		return fmt.Sprintf("group %s: every rank completed #%d and nothing is in flight", r.Group, r.AllCompleted)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "group %s: ", r.Group)
	if r.FirstIncomplete > 0 {
		op := r.Op
		if op == "" {
			op = "collective"
		}
		if len(r.NeverArrived) > 0 {
			fmt.Fprintf(&b, "rank(s) %s never arrived at %s #%d", joinRanks(r.NeverArrived), op, r.FirstIncomplete)
		} else {
			fmt.Fprintf(&b, "every rank arrived at %s #%d, which did not complete", op, r.FirstIncomplete)
		}
		fmt.Fprintf(&b, " (all completed #%d)", r.AllCompleted)
		if len(r.NoDump) > 0 {
			fmt.Fprintf(&b, "; no dump from rank(s) %s: stopped, dead, or stuck where it could not write one", joinRanks(r.NoDump))
		}
		if len(r.Arrived) > 0 {
			fmt.Fprintf(&b, "; rank(s) %s are inside it or failed in it", joinRanks(r.Arrived))
		}
		if r.Furthest > r.FirstIncomplete && len(r.Behind) > 0 {
			op := r.FurthestOp
			if op == "" {
				op = "collective"
			}
			fmt.Fprintf(&b, "; the furthest is %s #%d, which rank(s) %s never called", op, r.Furthest, joinRanks(r.Behind))
		}
	}
	if len(r.Mismatches) > 0 {
		if r.FirstIncomplete > 0 {
			b.WriteString("; ")
		}
		b.WriteString(r.Mismatches[0].Text)
	}
	return b.String()
}

// hangMismatches compares the ranks' records of each collective; a rank
// whose records match the others' shifted by one is out of order (it
// skipped or added a collective).
func hangMismatches(st map[int]*rankState, ranks []int, limit int) []HangMismatch {
	seqs := map[int64]bool{}
	for _, s := range st {
		for q := range s.bySeq {
			seqs[q] = true
		}
	}
	order := make([]int64, 0, len(seqs))
	for q := range seqs {
		order = append(order, q)
	}
	sort.Slice(order, func(i, j int) bool { return order[i] < order[j] })
	var out []HangMismatch
	for _, q := range order {
		byRank := map[int]Collective{}
		var have []int
		for _, r := range ranks {
			if s := st[r]; s != nil {
				if c, ok := s.bySeq[q]; ok {
					byRank[r] = c
					have = append(have, r)
				}
			}
		}
		if len(have) < 2 {
			continue
		}
		for _, mm := range mismatches(have, byRank) {
			out = append(out, describeMismatch(q, mm, st))
			if len(out) >= limit {
				return out
			}
		}
	}
	return out
}

func describeMismatch(q int64, mm Mismatch, st map[int]*rankState) HangMismatch {
	// The minority value's ranks, and the majority's.
	var minority, majority []int
	var minV, majV string
	for v, rs := range mm.Values {
		if majority == nil || len(rs) > len(majority) || (len(rs) == len(majority) && v < majV) {
			if majority != nil {
				minority, minV = majority, majV
			}
			majority, majV = rs, v
		} else if minority == nil || len(rs) < len(minority) {
			minority, minV = rs, v
		}
	}
	h := HangMismatch{Seq: q, Field: mm.Field, Values: mm.Values}
	h.Text = fmt.Sprintf("#%d: rank(s) %s called it with %s %q, rank(s) %s with %q", q, joinRanks(minority), mm.Field, minV, joinRanks(majority), majV)
	if len(minority) > 0 && len(majority) > 0 {
		a, b := st[minority[0]], st[majority[0]]
		switch {
		case shifted(a, b, q, 1):
			h.Field = "order"
			h.Text = fmt.Sprintf("#%d: rank(s) %s are one collective ahead of rank(s) %s from here (they skipped %s #%d, or the others called one more)", q, joinRanks(minority), joinRanks(majority), b.bySeq[q].Op, q)
		case shifted(a, b, q, -1):
			h.Field = "order"
			h.Text = fmt.Sprintf("#%d: rank(s) %s are one collective behind rank(s) %s from here (they called %s #%d that the others did not)", q, joinRanks(minority), joinRanks(majority), a.bySeq[q].Op, q)
		}
	}
	return h
}

// shifted: a's records from q equal b's from q+d (for the next few).
func shifted(a, b *rankState, q int64, d int64) bool {
	n := 0
	for i := int64(0); i < 3; i++ {
		ca, oka := a.bySeq[q+i]
		cb, okb := b.bySeq[q+i+d]
		if !oka || !okb {
			break
		}
		if len(mismatches([]int{0, 1}, map[int]Collective{0: ca, 1: cb})) > 0 {
			return false
		}
		n++
	}
	return n > 0
}
