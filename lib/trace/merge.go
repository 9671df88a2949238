package trace

import (
	"fmt"
	"sort"
)

// MergedSchema is the schema of gbtrace merge's lines.
const MergedSchema = "gpubridge.trace-merged/v1"

// RankView is one rank's part of a merged collective, on the reference
// rank's clock.
type RankView struct {
	Rank    int     `json:"rank"`
	Arrived int64   `json:"arrived"`
	Start   *int64  `json:"start"`
	End     *int64  `json:"end"`
	WaitNs  int64   `json:"wait_ns"` // from its arrival to the last rank's
	Result  string  `json:"result"`
	Error   string  `json:"error,omitempty"`
	Step    string  `json:"step,omitempty"`
	Leader  bool    `json:"leader,omitempty"`
	Async   bool    `json:"async,omitempty"` // called with async_op=True (DDP's buckets): the caller went on computing
	Phases  []Phase `json:"phases"`
	Bridge  *Bridge `json:"bridge,omitempty"` // a leader's: gbbridge's part, on the reference clock
}

// Mismatch is a field on which the ranks' records of one collective differ:
// each value with the ranks that gave it.
type Mismatch struct {
	Field  string           `json:"field"`
	Values map[string][]int `json:"values"`
}

// Merged is one collective (group, seq) with every rank's record.
type Merged struct {
	Schema       string     `json:"schema"`
	Group        string     `json:"group"`
	Seq          int64      `json:"seq"`
	Op           string     `json:"op"`
	Bytes        int64      `json:"bytes"`
	DType        *string    `json:"dtype"`
	ReduceOp     *string    `json:"reduce_op"`
	Size         int        `json:"size"`     // the group's ranks
	Seen         int        `json:"seen"`     // ranks with a record of it
	Complete     bool       `json:"complete"` // every rank's record, each ended ok
	FirstArrival int64      `json:"first_arrival"`
	LastArrival  int64      `json:"last_arrival"`
	LastRank     int        `json:"last_rank"` // the rank that arrived last
	End          *int64     `json:"end"`       // the last rank's end
	TimeNs       *int64     `json:"time_ns"`   // from the last arrival to the last end
	SkewNs       int64      `json:"skew_ns"`   // from the first arrival to the last
	AlignErrorNs *int64     `json:"align_error_ns"`
	Mismatches   []Mismatch `json:"mismatches,omitempty"`
	// BridgeStart is when the bridged step could start: the last leader's
	// all_arrived (gbbridge's parts, docs/TRACING.md §7); BridgeWaitedFor
	// the rank the leaders waited for there (the peer whose first frame
	// came last after a leader's start), BridgeWaitNs for how long.
	BridgeStart     *int64     `json:"bridge_start,omitempty"`
	BridgeWaitedFor *int       `json:"bridge_waited_for,omitempty"`
	BridgeWaitNs    int64      `json:"bridge_wait_ns,omitempty"`
	Ranks           []RankView `json:"ranks"`
}

// MergeResult is what Merge returns: the collectives in (group, seq) order,
// and what the reader should know about the alignment.
type MergeResult struct {
	Collectives []Merged
	Warnings    []string
}

type key struct {
	group string
	seq   int64
}

// Merge aligns every rank's records of every collective by (group, seq) and
// puts their times on the reference rank's clock (the ranks' clock offsets;
// unmeasured offsets count as 0, which is exact only on one boot). A rank
// with several sources (a trace and a dump) counts each collective once,
// preferring an ended record to an in-flight one.
func Merge(srcs []*Source) MergeResult {
	var res MergeResult
	recs := map[key]map[int]Collective{}
	sizes := map[string]int{}
	boots := map[string]bool{}
	unmeasured := 0
	var alignErr *int64
	offsets := map[int]int64{}
	for _, s := range srcs {
		off, ok := s.Offset()
		if !ok {
			unmeasured++
		} else if e := s.Header.Clock.ErrorNs; e != nil && (alignErr == nil || *e > *alignErr) {
			alignErr = ptr(*e)
		}
		boots[s.Header.Clock.Boot] = true
		offsets[s.Rank()] = off
		for _, c := range s.Collectives {
			k := key{c.Group.Name, c.Seq}
			if recs[k] == nil {
				recs[k] = map[int]Collective{}
			}
			if old, ok := recs[k][c.Rank]; ok && old.Result != ResultInFlight {
				continue
			}
			recs[k][c.Rank] = c
			sizes[c.Group.Name] = max(sizes[c.Group.Name], c.Group.Size)
		}
	}
	if unmeasured > 0 && len(boots) > 1 {
		res.Warnings = append(res.Warnings, fmt.Sprintf("%d of %d sources have no measured clock offset and the ranks ran on %d boots: their times are not aligned (trace with GPUBRIDGE_TRACE, which measures them)", unmeasured, len(srcs), len(boots)))
		alignErr = nil
	} else if unmeasured > 0 && alignErr == nil && len(boots) == 1 {
		alignErr = ptr(0) // one boot: one monotonic clock
	}
	keys := make([]key, 0, len(recs))
	for k := range recs {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].group != keys[j].group {
			return keys[i].group < keys[j].group
		}
		return keys[i].seq < keys[j].seq
	})
	for _, k := range keys {
		res.Collectives = append(res.Collectives, mergeOne(k, recs[k], sizes[k.group], offsets, alignErr))
	}
	return res
}

func shift(p *int64, off int64) *int64 {
	if p == nil {
		return nil
	}
	return ptr(*p - off)
}

func mergeOne(k key, byRank map[int]Collective, size int, offsets map[int]int64, alignErr *int64) Merged {
	ranks := make([]int, 0, len(byRank))
	for r := range byRank {
		ranks = append(ranks, r)
	}
	sort.Ints(ranks)
	first := byRank[ranks[0]]
	m := Merged{Schema: MergedSchema, Group: k.group, Seq: k.seq, Op: first.Op, Bytes: first.Bytes,
		DType: first.DType, ReduceOp: first.ReduceOp, Size: size, Seen: len(ranks), AlignErrorNs: alignErr}
	m.Complete = len(ranks) == size
	var end *int64
	for i, r := range ranks {
		c := byRank[r]
		off := offsets[r]
		v := RankView{Rank: r, Arrived: c.Arrived - off, Start: shift(c.Start, off), End: shift(c.End, off),
			Result: c.Result, Error: c.Error, Step: c.Step, Leader: c.Leader, Async: c.Async}
		for _, p := range c.Phases {
			v.Phases = append(v.Phases, Phase{Name: p.Name, Start: p.Start - off, End: shift(p.End, off),
				GPUStart: shift(p.GPUStart, off), GPUEnd: shift(p.GPUEnd, off)})
		}
		if b := c.Bridge; b != nil {
			v.Bridge = shiftBridge(b, off)
			m.noteBridge(v.Bridge)
		}
		if c.Result != ResultOK {
			m.Complete = false
		}
		if i == 0 || v.Arrived < m.FirstArrival {
			m.FirstArrival = v.Arrived
		}
		if i == 0 || v.Arrived > m.LastArrival {
			m.LastArrival, m.LastRank = v.Arrived, r
		}
		if v.End != nil && (end == nil || *v.End > *end) {
			end = ptr(*v.End)
		}
		m.Ranks = append(m.Ranks, v)
	}
	for i := range m.Ranks {
		m.Ranks[i].WaitNs = m.LastArrival - m.Ranks[i].Arrived
	}
	m.SkewNs = m.LastArrival - m.FirstArrival
	allEnded := true
	for _, v := range m.Ranks {
		allEnded = allEnded && v.End != nil
	}
	if allEnded && end != nil {
		m.End = end
		m.TimeNs = ptr(max(*end-m.LastArrival, 0))
	}
	m.Mismatches = mismatches(ranks, byRank)
	return m
}

// shiftBridge is b on the reference clock.
func shiftBridge(b *Bridge, off int64) *Bridge {
	out := *b
	out.Start, out.AllArrived, out.End = b.Start-off, b.AllArrived-off, b.End-off
	return &out
}

// noteBridge takes a leader's bridge part into the bridged step's start and
// the peer it waited for longest.
func (m *Merged) noteBridge(b *Bridge) {
	if m.BridgeStart == nil || b.AllArrived > *m.BridgeStart {
		m.BridgeStart = ptr(b.AllArrived)
	}
	for _, p := range b.Peers {
		if p.Rank != nil && p.ArrivalSkewNs != nil && *p.ArrivalSkewNs > m.BridgeWaitNs {
			m.BridgeWaitedFor, m.BridgeWaitNs = ptr32(*p.Rank), *p.ArrivalSkewNs
		}
	}
}

func ptr32(v int) *int { return &v }

// callFields are what every rank must call a collective with.
var callFields = []struct {
	name string
	get  func(c *Collective) string
}{
	{"op", func(c *Collective) string { return c.Op }},
	{"bytes", func(c *Collective) string { return fmt.Sprint(c.Bytes) }},
	{"dtype", func(c *Collective) string { return deref(c.DType) }},
	{"reduce_op", func(c *Collective) string { return deref(c.ReduceOp) }},
	{"root", func(c *Collective) string {
		if c.Root == nil {
			return ""
		}
		return fmt.Sprint(*c.Root)
	}},
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func mismatches(ranks []int, byRank map[int]Collective) []Mismatch {
	var out []Mismatch
	for _, f := range callFields {
		vals := map[string][]int{}
		for _, r := range ranks {
			c := byRank[r]
			v := f.get(&c)
			vals[v] = append(vals[v], r)
		}
		if len(vals) > 1 {
			out = append(out, Mismatch{Field: f.name, Values: vals})
		}
	}
	return out
}
