package trace

import (
	"sort"
)

// StepSplit is one rank's training step (a step record) split into
// compute and communication from its collectives' records
// (docs/STRAGGLERS.md, "What is measured, what is inferred"). Measured:
// the step's start and end, its samples, each collective's arrival, end and
// phases, and every rank's arrival (so when the last peer arrived).
// Inferred: which of that time the rank spent blocked (Comm), and so its
// compute. On a GPU, when the step and its collectives carry device times
// (tracing on), the split is of the device's timeline (Device): the host's
// times only say when it queued the work.
type StepSplit struct {
	Rank    int   `json:"rank"`
	Step    int64 `json:"step"`
	Samples int64 `json:"samples"`
	Start   int64 `json:"start"`
	End     int64 `json:"end"`
	StepNs  int64 `json:"step_ns"`
	// ReadyNs: from the step's start to the rank's arrival at the step's
	// last collective, less the time blocked in synchronous collectives
	// before it: the forward and backward work that scales with the
	// samples (DDP's last bucket is called when backward ends).
	ReadyNs int64 `json:"ready_ns"`
	// PostNs: compute after that arrival and outside blocked time (the
	// optimizer step): a per-step cost, not per sample.
	PostNs    int64 `json:"post_ns"`
	ComputeNs int64 `json:"compute_ns"` // ReadyNs + PostNs = StepNs - CommNs
	// CommNs: the time the rank was blocked: in synchronous collectives
	// (arrival to end), and for asynchronous ones (DDP's buckets, which
	// overlap backward) the tail from the last one's arrival to the end of
	// the last to end, when the caller can only wait.
	CommNs int64 `json:"comm_ns"`
	// WaitNs: of CommNs, the part before the last peer arrived at the
	// collectives being waited for (from every rank's arrivals).
	WaitNs int64 `json:"wait_ns"`
	// TransferNs: CommNs - WaitNs, the time every rank was there and the
	// link (island, bridge) was working.
	TransferNs  int64            `json:"transfer_ns"`
	Device      bool             `json:"device,omitempty"` // the split is of the GPU's timeline
	Collectives int              `json:"collectives"`
	Phases      map[string]int64 `json:"phases_ns"` // time in each phase, summed over the step's collectives (async ones overlap compute)
}

// stepColl is one rank's ended collective, for the split: on the host,
// and on the device when it has device times (dev).
type stepColl struct {
	arrived, end, lastArrival int64
	async                     bool
	phases                    []Phase
	dev                       bool
	devArrived, devEnd        int64
	devLast                   int64 // every rank's device arrival, the last; 0: not every rank has one
}

// deviceTimes: a rank's collective on its GPU: when its stream passed the
// caller's work (the end of the "running" step, after which the stream
// waits for it) and its last step's end.
func deviceTimes(v *RankView) (int64, int64, bool) {
	for _, p := range v.Phases {
		if p.Name == "running" && p.GPUEnd != nil {
			last := v.Phases[len(v.Phases)-1]
			if last.GPUEnd == nil {
				return 0, 0, false
			}
			return *p.GPUEnd, *last.GPUEnd, true
		}
	}
	return 0, 0, false
}

type span struct{ lo, hi int64 }

// SplitSteps splits every step record (steps, on the reference clock)
// into compute and communication from the merged collectives whose
// arrival on that rank falls within the step; collectives outside every
// step (a sampler's plan between steps) are not counted. Out: by rank, then
// step start.
func SplitSteps(merged []Merged, steps []Step) []StepSplit {
	byRank := map[int][]stepColl{}
	for i := range merged {
		m := &merged[i]
		devLast, all := int64(0), true
		for j := range m.Ranks {
			a, _, ok := deviceTimes(&m.Ranks[j])
			all = all && ok
			devLast = max(devLast, a)
		}
		if !all || len(m.Ranks) < m.Size {
			devLast = 0
		}
		for j := range m.Ranks {
			v := &m.Ranks[j]
			if v.End == nil || v.Result != ResultOK {
				continue
			}
			c := stepColl{arrived: v.Arrived, end: *v.End, lastArrival: m.LastArrival, async: v.Async, phases: v.Phases, devLast: devLast}
			c.devArrived, c.devEnd, c.dev = deviceTimes(v)
			byRank[v.Rank] = append(byRank[v.Rank], c)
		}
	}
	for _, cs := range byRank {
		sort.Slice(cs, func(i, j int) bool { return cs[i].arrived < cs[j].arrived })
	}
	sorted := append([]Step(nil), steps...)
	sort.SliceStable(sorted, func(i, j int) bool {
		if sorted[i].Rank != sorted[j].Rank {
			return sorted[i].Rank < sorted[j].Rank
		}
		return sorted[i].Start < sorted[j].Start
	})
	out := make([]StepSplit, 0, len(sorted))
	for _, st := range sorted {
		cs := byRank[st.Rank]
		lo := sort.Search(len(cs), func(i int) bool { return cs[i].arrived >= st.Start })
		hi := sort.Search(len(cs), func(i int) bool { return cs[i].arrived >= st.End })
		out = append(out, splitStep(st, cs[lo:hi]))
	}
	return out
}

// splitStep splits on the device's timeline when the step and every one of
// its collectives have one (and every rank's device arrival, for the
// waits), else on the host's.
func splitStep(st Step, cs []stepColl) StepSplit {
	if st.GPUStart != nil {
		dev := append([]stepColl(nil), cs...)
		ok := true
		for i := range dev {
			c := &dev[i]
			ok = ok && c.dev && c.devLast != 0
			c.arrived, c.end, c.lastArrival = c.devArrived, c.devEnd, c.devLast
		}
		if ok {
			s := splitOne(st, *st.GPUStart, *st.GPUEnd, dev, true)
			s.Device = true
			return s
		}
	}
	return splitOne(st, st.Start, st.End, cs, false)
}

// splitOne splits a step that ran from start to end (on one timeline,
// which cs's times are on).
func splitOne(st Step, start, end int64, cs []stepColl, device bool) StepSplit {
	s := StepSplit{Rank: st.Rank, Step: st.Step, Samples: st.Samples, Start: st.Start, End: st.End,
		StepNs: end - start, Collectives: len(cs), Phases: map[string]int64{}}
	if len(cs) == 0 {
		s.ReadyNs, s.ComputeNs = s.StepNs, s.StepNs
		return s
	}
	var blocked, waiting []span
	lastArr := start
	var tail span
	tailLA := int64(0)
	hasAsync := false
	for _, c := range cs {
		lastArr = max(lastArr, c.arrived)
		for _, p := range c.phases {
			switch {
			case device && p.GPUStart != nil && p.GPUEnd != nil:
				s.Phases[p.Name] += *p.GPUEnd - *p.GPUStart
			case !device && p.End != nil:
				s.Phases[p.Name] += *p.End - p.Start
			}
		}
		if !c.async {
			blocked = append(blocked, span{c.arrived, c.end})
			waiting = append(waiting, span{c.arrived, min(c.end, c.lastArrival)})
			continue
		}
		if !hasAsync {
			tail, hasAsync = span{c.arrived, c.end}, true
		}
		tail.lo, tail.hi = max(tail.lo, c.arrived), max(tail.hi, c.end)
		tailLA = max(tailLA, c.lastArrival)
	}
	if hasAsync && tail.hi > tail.lo {
		blocked = append(blocked, tail)
		waiting = append(waiting, span{tail.lo, min(tail.hi, tailLA)})
	}
	in := span{start, end}
	blocked = union(blocked, in)
	s.CommNs = measure(blocked, in)
	s.WaitNs = measure(intersect(union(waiting, in), blocked), in)
	s.TransferNs = s.CommNs - s.WaitNs
	s.ComputeNs = s.StepNs - s.CommNs
	s.ReadyNs = (lastArr - start) - measure(blocked, span{start, lastArr})
	s.PostNs = s.ComputeNs - s.ReadyNs
	return s
}

// union of spans clipped to in, sorted and disjoint.
func union(spans []span, in span) []span {
	var c []span
	for _, x := range spans {
		x.lo, x.hi = max(x.lo, in.lo), min(x.hi, in.hi)
		if x.hi > x.lo {
			c = append(c, x)
		}
	}
	sort.Slice(c, func(i, j int) bool { return c[i].lo < c[j].lo })
	var out []span
	for _, x := range c {
		if n := len(out); n > 0 && x.lo <= out[n-1].hi {
			out[n-1].hi = max(out[n-1].hi, x.hi)
			continue
		}
		out = append(out, x)
	}
	return out
}

// intersect of two sorted disjoint span lists.
func intersect(a, b []span) []span {
	var out []span
	for i, j := 0, 0; i < len(a) && j < len(b); {
		lo, hi := max(a[i].lo, b[j].lo), min(a[i].hi, b[j].hi)
		if hi > lo {
			out = append(out, span{lo, hi})
		}
		if a[i].hi < b[j].hi {
			i++
		} else {
			j++
		}
	}
	return out
}

// measure is the length of sorted disjoint spans within in.
func measure(spans []span, in span) int64 {
	t := int64(0)
	for _, x := range spans {
		if lo, hi := max(x.lo, in.lo), min(x.hi, in.hi); hi > lo {
			t += hi - lo
		}
	}
	return t
}
