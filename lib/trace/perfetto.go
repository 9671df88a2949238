package trace

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
)

// PerfettoSchema is written in the export's otherData.
const PerfettoSchema = "gpubridge.trace-perfetto/v1"

// event is one Chrome trace event (the JSON format ui.perfetto.dev and
// chrome://tracing open): X complete events, M metadata.
type event struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat,omitempty"`
	Ph   string         `json:"ph"`
	Ts   float64        `json:"ts"` // µs
	Dur  *float64       `json:"dur,omitempty"`
	PID  int            `json:"pid"`
	TID  int            `json:"tid"`
	Args map[string]any `json:"args,omitempty"`
}

// Track ids within a rank's process.
const (
	tidUser = 1   // user phases
	tidGPU  = 500 // + lane: device phases
	tidBase = 100 // + lane: collectives and their host phases
)

// Perfetto writes the sources as one Chrome trace JSON document on one
// line: a process per rank, on the reference clock (offsets applied); per
// rank one track per lane of collectives (a collective that overlaps
// another on that rank, another group's or an async one, takes the next
// lane) holding each collective with its host phases nested inside, a
// device track per lane for the GPU phases, and a track for the user's own
// phases. In-flight collectives end at the time of their dump.
func Perfetto(w io.Writer, srcs []*Source) error {
	var evs []event
	var t0 int64 = -1
	type span struct {
		c   Collective
		off int64
		end int64
	}
	spans := map[int][]span{}
	procs := map[int]string{}
	for _, s := range srcs {
		off, _ := s.Offset()
		r := s.Rank()
		name := fmt.Sprintf("rank %d", r)
		if s.Header.Host != "" {
			name += " (" + s.Header.Host + ")"
		}
		procs[r] = name
		for _, c := range s.Collectives {
			end := s.Header.MonoNs
			if c.End != nil {
				end = *c.End
			}
			end = max(end, c.Arrived)
			spans[r] = append(spans[r], span{c, off, end})
			if t0 < 0 || c.Arrived-off < t0 {
				t0 = c.Arrived - off
			}
		}
		for _, p := range s.Phases {
			if t0 < 0 || p.Start-off < t0 {
				t0 = p.Start - off
			}
		}
	}
	us := func(ns int64) float64 { return float64(ns-t0) / 1e3 }
	dur := func(a, b int64) *float64 { d := float64(max(b-a, 0)) / 1e3; return &d }
	ranks := make([]int, 0, len(procs))
	for r := range procs {
		ranks = append(ranks, r)
	}
	sort.Ints(ranks)
	for _, r := range ranks {
		evs = append(evs, event{Name: "process_name", Ph: "M", PID: r, Args: map[string]any{"name": procs[r]}},
			event{Name: "process_sort_index", Ph: "M", PID: r, Args: map[string]any{"sort_index": r}})
		sp := spans[r]
		sort.SliceStable(sp, func(i, j int) bool { return sp[i].c.Arrived-sp[i].off < sp[j].c.Arrived-sp[j].off })
		var laneEnd []int64
		used := map[int]bool{}
		for _, x := range sp {
			a, e := x.c.Arrived-x.off, x.end-x.off
			lane := 0
			for lane < len(laneEnd) && laneEnd[lane] > a {
				lane++
			}
			if lane == len(laneEnd) {
				laneEnd = append(laneEnd, 0)
			}
			laneEnd[lane] = e
			if !used[lane] {
				used[lane] = true
				evs = append(evs, event{Name: "thread_name", Ph: "M", PID: r, TID: tidBase + lane, Args: map[string]any{"name": fmt.Sprintf("collectives %d", lane)}})
			}
			c := x.c
			name := fmt.Sprintf("%s #%d %s", c.Op, c.Seq, Human(c.Bytes))
			if c.Result != ResultOK {
				name += " (" + c.Result + ")"
			}
			args := map[string]any{"group": c.Group.Name, "seq": c.Seq, "bytes": c.Bytes, "result": c.Result, "policy": c.Policy}
			if c.DType != nil {
				args["dtype"] = *c.DType
			}
			if c.Error != "" {
				args["error"] = firstLine(c.Error)
			}
			evs = append(evs, event{Name: name, Cat: "collective", Ph: "X", Ts: us(a), Dur: dur(a, e), PID: r, TID: tidBase + lane, Args: args})
			gpuLane := false
			for _, p := range c.Phases {
				pe := x.end
				if p.End != nil {
					pe = *p.End
				}
				evs = append(evs, event{Name: p.Name, Cat: "phase", Ph: "X", Ts: us(p.Start - x.off), Dur: dur(p.Start, pe), PID: r, TID: tidBase + lane})
				if p.GPUStart != nil && p.GPUEnd != nil {
					if !gpuLane && !used[tidGPU+lane] {
						used[tidGPU+lane] = true
						evs = append(evs, event{Name: "thread_name", Ph: "M", PID: r, TID: tidGPU + lane, Args: map[string]any{"name": fmt.Sprintf("gpu %d", lane)}})
					}
					gpuLane = true
					evs = append(evs, event{Name: p.Name, Cat: "gpu", Ph: "X", Ts: us(*p.GPUStart - x.off), Dur: dur(*p.GPUStart, *p.GPUEnd), PID: r, TID: tidGPU + lane,
						Args: map[string]any{"seq": c.Seq}})
				}
			}
		}
	}
	userNamed := map[int]bool{}
	for _, s := range srcs {
		off, _ := s.Offset()
		for _, p := range s.Phases {
			if !userNamed[p.Rank] {
				userNamed[p.Rank] = true
				evs = append(evs, event{Name: "thread_name", Ph: "M", PID: p.Rank, TID: tidUser, Args: map[string]any{"name": "phases"}})
			}
			evs = append(evs, event{Name: p.Name, Cat: "user", Ph: "X", Ts: us(p.Start - off), Dur: dur(p.Start, p.End), PID: p.Rank, TID: tidUser})
		}
	}
	doc := struct {
		TraceEvents     []event        `json:"traceEvents"`
		DisplayTimeUnit string         `json:"displayTimeUnit"`
		OtherData       map[string]any `json:"otherData"`
	}{evs, "ns", map[string]any{"schema": PerfettoSchema, "t0_ns": t0}}
	if doc.TraceEvents == nil {
		doc.TraceEvents = []event{}
	}
	b, err := json.Marshal(doc)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}
