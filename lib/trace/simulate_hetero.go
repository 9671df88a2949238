package trace

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
)

// SimClass is one hardware class of a simulated mixed job: Ranks ranks
// that each compute one sample in SampleNs.
type SimClass struct {
	Name     string
	Ranks    int
	SampleNs float64
}

// HeteroSimOptions describe a synchronous data-parallel job on mixed
// hardware: every step each rank computes its share of the global batch
// (OverheadNs plus its samples at its class's pace, times its jitter),
// arrives at the all_reduce, everyone leaves it CollectiveNs after the last
// arrival, and each rank computes PostNs more (the optimizer) before the
// next step.
type HeteroSimOptions struct {
	Classes      []SimClass
	Steps        int
	GlobalBatch  int  // samples per step over all ranks
	Uniform      bool // every rank gets the same share (else: in proportion to its class's speed, as a rebalancer would)
	OverheadNs   float64
	PostNs       float64
	CollectiveNs float64
	Jitter       float64 // relative SD of each rank's compute per step (Dist), independent per rank and step
	Common       float64 // relative SD of a factor every rank shares in a step
	LinkJitter   float64 // relative SD of the collective's time per step
	Dist         string
	Slow         []Slowdown // degraded compute: rank computes Factor more from step From
	SlowLink     []Slowdown // the collective takes Factor longer from step From (Rank unused)
	Seed         uint64
}

// Ranks is the job's size.
func (o *HeteroSimOptions) Ranks() int {
	n := 0
	for _, c := range o.Classes {
		n += c.Ranks
	}
	return n
}

// Check says what is wrong with the options.
func (o *HeteroSimOptions) Check() error {
	n := o.Ranks()
	switch {
	case len(o.Classes) == 0:
		return errors.New("no hardware class")
	case n < 2:
		return fmt.Errorf("%d ranks: at least 2", n)
	case o.Steps < 1:
		return fmt.Errorf("steps %d: at least 1", o.Steps)
	case n*o.Steps > 200_000_000:
		return errors.New("ranks x steps over 200 million")
	case o.GlobalBatch < n:
		return fmt.Errorf("global batch %d: at least one sample per rank (%d ranks)", o.GlobalBatch, n)
	case o.Jitter < 0 || o.Jitter > 0.5 || o.Common < 0 || o.Common > 0.5 || o.LinkJitter < 0 || o.LinkJitter > 0.5:
		return errors.New("jitter, common and link jitter must be in [0, 0.5]")
	case o.OverheadNs < 0 || o.PostNs < 0 || o.CollectiveNs < 0:
		return errors.New("overhead, post and collective times must not be negative")
	}
	for _, c := range o.Classes {
		if c.Ranks < 1 || c.SampleNs <= 0 || c.Name == "" {
			return fmt.Errorf("class %+v: a name, ranks >= 1 and a positive time per sample", c)
		}
	}
	if _, err := noise(o.Dist); err != nil {
		return err
	}
	for _, s := range append(append([]Slowdown(nil), o.Slow...), o.SlowLink...) {
		if s.Rank < 0 || s.Rank >= n || s.Factor < 0 || s.From < 0 {
			return fmt.Errorf("slowdown %+v: rank, factor or step out of range", s)
		}
	}
	return nil
}

// Describe names the classes as "32 x h100 (1.00 ms/sample), ...".
func (o *HeteroSimOptions) Describe() string {
	var parts []string
	for _, c := range o.Classes {
		parts = append(parts, fmt.Sprintf("%d×%s (%.3g ms/sample)", c.Ranks, c.Name, c.SampleNs/1e6))
	}
	return strings.Join(parts, ", ")
}

// HeteroSim is a simulated run: per step and rank, the samples and the
// times (ns, one clock).
type HeteroSim struct {
	Classes  []string // per rank
	Samples  []int    // per rank (the same every step)
	Start    [][]float64
	Arrival  [][]float64
	StepEnd  []float64 // every rank's step ends together
	CollEnd  []float64
	Transfer []float64 // the collective's time after the last arrival
}

// shares splits the global batch: evenly, or in proportion to each
// rank's speed (floors, then one more sample to the ranks with the largest
// remainders, lowest rank first).
func (o *HeteroSimOptions) shares() ([]int, []string, []float64) {
	var classes []string
	var pace []float64
	for _, c := range o.Classes {
		for i := 0; i < c.Ranks; i++ {
			classes = append(classes, c.Name)
			pace = append(pace, c.SampleNs)
		}
	}
	n := len(pace)
	w := make([]float64, n)
	total := 0.0
	for r := range w {
		w[r] = 1
		if !o.Uniform {
			w[r] = 1 / pace[r]
		}
		total += w[r]
	}
	out := make([]int, n)
	rem := make([]float64, n)
	left := o.GlobalBatch
	for r := range w {
		q := float64(o.GlobalBatch) * w[r] / total
		out[r] = max(1, int(q))
		rem[r] = q - float64(out[r])
		left -= out[r]
	}
	for left > 0 {
		best := 0
		for r := range rem {
			if rem[r] > rem[best] {
				best = r
			}
		}
		out[best]++
		rem[best]--
		left--
	}
	for left < 0 { // min-share floors overshot: take from the largest
		best := 0
		for r := range out {
			if out[r] > out[best] {
				best = r
			}
		}
		out[best]--
		left++
	}
	return out, classes, pace
}

// SimulateHetero runs the job.
func SimulateHetero(o HeteroSimOptions) (*HeteroSim, error) {
	if err := o.Check(); err != nil {
		return nil, err
	}
	z, _ := noise(o.Dist)
	draw := func(rng *rand.Rand, sd float64) float64 {
		if o.Dist == "lognormal" {
			return factor(rng, nil, sd)
		}
		return factor(rng, z, sd)
	}
	rng := rand.New(rand.NewPCG(o.Seed, 0x6a09e667f3bcc909))
	samples, classes, pace := o.shares()
	n := len(samples)
	sim := &HeteroSim{Classes: classes, Samples: samples, Start: make([][]float64, o.Steps), Arrival: make([][]float64, o.Steps),
		StepEnd: make([]float64, o.Steps), CollEnd: make([]float64, o.Steps), Transfer: make([]float64, o.Steps)}
	slow := make([]float64, n)
	link := 0.0
	t := 0.0
	for k := 0; k < o.Steps; k++ {
		for _, s := range o.Slow {
			if s.From == k {
				slow[s.Rank] = s.Factor
			}
		}
		for _, s := range o.SlowLink {
			if s.From == k {
				link = s.Factor
			}
		}
		common := draw(rng, o.Common)
		sim.Start[k] = make([]float64, n)
		sim.Arrival[k] = make([]float64, n)
		last := t
		for r := 0; r < n; r++ {
			c := (o.OverheadNs + float64(samples[r])*pace[r]) * (1 + slow[r]) * common * draw(rng, o.Jitter)
			sim.Start[k][r] = t
			sim.Arrival[k][r] = t + c
			last = math.Max(last, sim.Arrival[k][r])
		}
		x := o.CollectiveNs * (1 + link) * draw(rng, o.LinkJitter)
		sim.Transfer[k] = x
		sim.CollEnd[k] = last + x
		sim.StepEnd[k] = last + x + o.PostNs
		t = sim.StepEnd[k]
	}
	return sim, nil
}

// Data is what the heterogeneity-aware detector reads of the run.
func (s *HeteroSim) Data() HeteroData {
	steps := len(s.Start)
	n := len(s.Samples)
	d := HeteroData{Classes: s.Classes, Ready: make([][]float64, steps), Samples: make([][]float64, steps),
		Transfer: make([][]float64, steps)}
	for k := 0; k < steps; k++ {
		d.Ready[k], d.Samples[k], d.Transfer[k] = make([]float64, n), make([]float64, n), make([]float64, n)
		for r := 0; r < n; r++ {
			d.Ready[k][r] = s.Arrival[k][r] - s.Start[k][r]
			d.Samples[k][r] = float64(s.Samples[r])
			d.Transfer[k][r] = s.Transfer[k]
		}
	}
	return d
}

// Records turns the run into gpubridge.trace/v1 sources: per rank a
// header with its hardware class, one all_reduce and one step record per
// step, for gbtrace simulate --classes.
func (s *HeteroSim) Records(nbytes int64) []*Source {
	n := len(s.Samples)
	ranks := make([]int, n)
	for r := range ranks {
		ranks[r] = r
	}
	zero := int64(0)
	f32, sum := "float32", "sum"
	srcs := make([]*Source, n)
	for r := range srcs {
		srcs[r] = &Source{Name: "simulated", Format: "trace",
			Header: Header{Schema: Schema, Kind: KindRank, Rank: r, Host: "sim",
				Clock:    Clock{OffsetNs: &zero, ErrorNs: &zero, Method: "simulated"},
				Hardware: &Hardware{Vendor: "simulated", Class: s.Classes[r], Simulated: true}},
			Groups: map[string]Group{"sim": {Name: "sim", Rank: r, Size: n, Ranks: ranks, Policy: "native", Device: "sim"}}}
	}
	for k := range s.Start {
		end := int64(s.CollEnd[k])
		for r := 0; r < n; r++ {
			arr := int64(s.Arrival[k][r])
			srcs[r].Collectives = append(srcs[r].Collectives, Collective{
				Rank: r, Group: GroupRef{Name: "sim", Rank: r, Size: n}, Seq: int64(k + 1), Op: "all_reduce",
				Call: "allreduce", Bytes: nbytes, DType: &f32, ReduceOp: &sum, Policy: "native", Codec: "raw", Device: "sim",
				Arrived: arr, Start: &arr, End: &end, Result: ResultOK,
				Phases: []Phase{{Name: "native", Start: arr, End: &end}},
			})
			srcs[r].Steps = append(srcs[r].Steps, Step{Rank: r, Step: int64(k), Samples: int64(s.Samples[r]),
				Start: int64(s.Start[k][r]), End: int64(s.StepEnd[k])})
		}
	}
	return srcs
}

// HeteroROCOptions measure the heterogeneity-aware detector: Trials runs
// per slowdown, each with one random rank's compute slowed from Onset.
type HeteroROCOptions struct {
	Sim        HeteroSimOptions
	Detector   HeteroOptions
	Slowdowns  []float64
	Thresholds []float64
	Trials     int
	Onset      int
}

// HeteroROCSchema is the schema of gbtrace simulate --roc --classes' lines.
const HeteroROCSchema = "gpubridge.trace-hetero-roc/v1"

// HeteroROCRow is one slowdown at one threshold.
type HeteroROCRow struct {
	Schema      string  `json:"schema"`
	Classes     string  `json:"classes"`
	Ranks       int     `json:"ranks"`
	Steps       int     `json:"steps"`
	Window      int     `json:"window"`
	Calibrate   int     `json:"calibrate"`
	GlobalBatch int     `json:"global_batch"`
	Uniform     bool    `json:"uniform"`
	Dist        string  `json:"dist"`
	Jitter      float64 `json:"jitter"`
	Slowdown    float64 `json:"slowdown"`
	Threshold   float64 `json:"threshold"`
	Trials      int     `json:"trials"`
	ROCRates
	// ClassicFlags: clean rank-windows (after the calibration) that the
	// plain straggler detector flags at the same threshold, from the
	// same arrivals: the slower classes, when shares are uniform.
	ClassicFlags int `json:"classic_flags"`
}

// HeteroROC runs the trials.
func HeteroROC(o HeteroROCOptions) ([]HeteroROCRow, error) {
	det := o.Detector.withDefaults()
	if o.Trials < 1 || len(o.Slowdowns) == 0 {
		return nil, errors.New("at least one trial and one slowdown")
	}
	if len(o.Thresholds) == 0 {
		o.Thresholds = []float64{det.Threshold}
	}
	if o.Onset < det.Calibrate || o.Onset >= o.Sim.Steps {
		return nil, fmt.Errorf("onset %d: after the calibration (%d steps) and within the %d steps", o.Onset, det.Calibrate, o.Sim.Steps)
	}
	if err := o.Sim.Check(); err != nil {
		return nil, err
	}
	n := o.Sim.Ranks()
	var rows []HeteroROCRow
	for si, s := range o.Slowdowns {
		trials := make([]*rocTrial, o.Trials)
		classic := map[float64]int{}
		for t := range trials {
			sim := o.Sim
			sim.Seed = o.Sim.Seed + uint64(si)*1_000_003 + uint64(t)*7919
			victim := int(sim.Seed % uint64(n))
			sim.Slow = []Slowdown{{Rank: victim, Factor: s, From: o.Onset}}
			run, err := SimulateHetero(sim)
			if err != nil {
				return nil, err
			}
			scores, _, err := ScoreHetero(run.Data(), det)
			if err != nil {
				return nil, err
			}
			plain := ScoreWindows(run.Arrival, StragglerOptions{Window: det.Window})
			tr := newROCTrial(o.Thresholds)
			for i, ws := range scores {
				if ws.Calibrating {
					continue
				}
				tr.add(o.Thresholds, ws.Rank == victim, ws.Window, ws.Lo, ws.Hi, o.Onset, ws.Score,
					func(th float64) bool { return ws.Score >= th && ws.Slowdown >= det.MinSlowdown })
				if clean := ws.Rank != victim || ws.Hi <= o.Onset; clean && i < len(plain) {
					for _, th := range o.Thresholds {
						if plain[i].Score >= th {
							classic[th]++
						}
					}
				}
			}
			trials[t] = tr
		}
		for _, th := range o.Thresholds {
			rows = append(rows, HeteroROCRow{Schema: HeteroROCSchema, Classes: o.Sim.Describe(), Ranks: n, Steps: o.Sim.Steps,
				Window: det.Window, Calibrate: det.Calibrate, GlobalBatch: o.Sim.GlobalBatch, Uniform: o.Sim.Uniform,
				Dist: distName(o.Sim.Dist), Jitter: o.Sim.Jitter, Slowdown: s, Threshold: th, Trials: o.Trials,
				ROCRates: rocRates(trials, th, o.Onset, det.Window), ClassicFlags: classic[th]})
		}
	}
	return rows, nil
}
