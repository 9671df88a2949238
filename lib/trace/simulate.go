package trace

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
)

// Slowdown makes Rank compute Factor longer (0.02: 2%) from step From on.
type Slowdown struct {
	Rank   int
	Factor float64
	From   int
}

// SimOptions describe a synchronous data-parallel job: every step each rank
// computes, then all of them all-reduce; a rank arrives at the collective
// when its computation ends, and everyone leaves it together once the last
// has arrived.
type SimOptions struct {
	Ranks        int
	Steps        int
	ComputeNs    float64 // the mean computation per step
	CollectiveNs float64 // the collective once everyone is there
	// Jitter is the standard deviation of each rank's computation time
	// per step, relative to its mean (0.05: 5%), drawn independently for
	// every rank and step from Dist.
	Jitter float64
	// Common is the standard deviation (relative) of a factor every rank
	// shares in a step (the input pipeline, the network): it moves every
	// arrival of the step alike.
	Common float64
	Dist   string // gaussian (default), lognormal, uniform, t3, t5 (Student's t, scaled to Jitter)
	Slow   []Slowdown
	Seed   uint64
}

// Check says what is wrong with the options.
func (o *SimOptions) Check() error {
	switch {
	case o.Ranks < 2:
		return fmt.Errorf("ranks %d: at least 2", o.Ranks)
	case o.Steps < 1:
		return fmt.Errorf("steps %d: at least 1", o.Steps)
	case o.Ranks*o.Steps > 200_000_000:
		return errors.New("ranks x steps over 200 million")
	case o.Jitter < 0 || o.Jitter > 0.5 || o.Common < 0 || o.Common > 0.5:
		return errors.New("jitter and common jitter must be in [0, 0.5]")
	case o.ComputeNs <= 0:
		return errors.New("compute time must be positive")
	}
	if _, err := noise(o.Dist); err != nil {
		return err
	}
	for _, s := range o.Slow {
		if s.Rank < 0 || s.Rank >= o.Ranks || s.Factor < 0 || s.From < 0 {
			return fmt.Errorf("slowdown %+v: rank, factor or step out of range", s)
		}
	}
	return nil
}

// noise returns a draw of standard deviation 1 and mean 0 from a
// distribution (lognormal: from a multiplicative factor, below).
func noise(dist string) (func(r *rand.Rand) float64, error) {
	switch dist {
	case "", "gaussian":
		return func(r *rand.Rand) float64 { return r.NormFloat64() }, nil
	case "uniform":
		return func(r *rand.Rand) float64 { return (2*r.Float64() - 1) * math.Sqrt(3) }, nil
	case "lognormal":
		return nil, nil // multiplicative: see factor
	case "t3", "t5":
		nu := 3.0
		if dist == "t5" {
			nu = 5
		}
		scale := math.Sqrt((nu - 2) / nu)
		return func(r *rand.Rand) float64 {
			chi := 0.0
			for i := 0; i < int(nu); i++ {
				z := r.NormFloat64()
				chi += z * z
			}
			return r.NormFloat64() / math.Sqrt(chi/nu) * scale
		}, nil
	}
	return nil, fmt.Errorf("distribution %q: one of gaussian, lognormal, uniform, t3, t5", dist)
}

// factor draws one multiplicative factor of mean 1 and relative SD sd.
func factor(r *rand.Rand, z func(*rand.Rand) float64, sd float64) float64 {
	if sd == 0 {
		return 1
	}
	if z == nil { // lognormal with that mean and SD
		s2 := math.Log(1 + sd*sd)
		return math.Exp(r.NormFloat64()*math.Sqrt(s2) - s2/2)
	}
	return math.Max(0.01, 1+sd*z(r))
}

// Simulate returns every rank's arrival time (ns) at every step's
// collective, and every step's end: arrivals[k][r], ends[k].
func Simulate(o SimOptions) (arrivals [][]float64, ends []float64, err error) {
	if err := o.Check(); err != nil {
		return nil, nil, err
	}
	z, _ := noise(o.Dist)
	rng := rand.New(rand.NewPCG(o.Seed, 0x9e3779b97f4a7c15))
	slow := make([]float64, o.Ranks)
	arrivals = make([][]float64, o.Steps)
	ends = make([]float64, o.Steps)
	t := 0.0
	for k := 0; k < o.Steps; k++ {
		for _, s := range o.Slow {
			if s.From == k {
				slow[s.Rank] = s.Factor
			}
		}
		common := factor(rng, nil, o.Common)
		if o.Dist != "lognormal" {
			common = factor(rng, z, o.Common)
		}
		a := make([]float64, o.Ranks)
		last := 0.0
		for r := range a {
			a[r] = t + o.ComputeNs*(1+slow[r])*common*factor(rng, z, o.Jitter)
			last = math.Max(last, a[r])
		}
		arrivals[k] = a
		t = last + o.CollectiveNs
		ends[k] = t
	}
	return arrivals, ends, nil
}

// Records turns a simulation into gpubridge.trace/v1 sources (one per
// rank, group "sim", one all_reduce of nbytes per step), for gbtrace
// simulate.
func Records(o SimOptions, arrivals [][]float64, ends []float64, nbytes int64) []*Source {
	srcs := make([]*Source, o.Ranks)
	ranks := make([]int, o.Ranks)
	for r := range ranks {
		ranks[r] = r
	}
	zero := int64(0)
	for r := range srcs {
		srcs[r] = &Source{Name: "simulated", Format: "trace",
			Header: Header{Schema: Schema, Kind: KindRank, Rank: r, Host: "sim", Clock: Clock{OffsetNs: &zero, ErrorNs: &zero, Method: "simulated"}},
			Groups: map[string]Group{"sim": {Name: "sim", Rank: r, Size: o.Ranks, Ranks: ranks, Policy: "native", Device: "sim"}}}
	}
	f32, sum := "float32", "sum"
	for k, a := range arrivals {
		for r := range a {
			arr, end := int64(a[r]), int64(ends[k])
			start := int64(a[r])
			srcs[r].Collectives = append(srcs[r].Collectives, Collective{
				Rank: r, Group: GroupRef{Name: "sim", Rank: r, Size: o.Ranks}, Seq: int64(k + 1), Op: "all_reduce",
				Call: "allreduce", Bytes: nbytes, DType: &f32, ReduceOp: &sum, Policy: "native", Codec: "raw", Device: "sim",
				Arrived: arr, Start: &start, End: &end, Result: ResultOK,
				Phases: []Phase{{Name: "native", Start: start, End: &end}},
			})
		}
	}
	return srcs
}

// ROCOptions measure the detector on simulated jobs: Trials jobs of each
// slowdown, each with one rank (a random one) slowed from step Onset.
type ROCOptions struct {
	Sim        SimOptions
	Detector   StragglerOptions
	Slowdowns  []float64 // e.g. 0.01, 0.02, 0.05, 0.1
	Thresholds []float64 // the ROC's points (Detector.Threshold is the operating point)
	Trials     int
	Onset      int // the step the slowdown starts (a window boundary is cleanest)
}

// ROCSchema is the schema of gbtrace simulate --roc's lines.
const ROCSchema = "gpubridge.trace-roc/v1"

// ROCRow is one slowdown at one threshold.
type ROCRow struct {
	Schema    string  `json:"schema"`
	Dist      string  `json:"dist"`
	Jitter    float64 `json:"jitter"`
	Common    float64 `json:"common"`
	Ranks     int     `json:"ranks"`
	Steps     int     `json:"steps"`
	Window    int     `json:"window"`
	Slowdown  float64 `json:"slowdown"`
	Threshold float64 `json:"threshold"`
	Trials    int     `json:"trials"`
	ROCRates
}

// ROC runs the trials; rows per slowdown and threshold.
func ROC(o ROCOptions) ([]ROCRow, error) {
	det := o.Detector.withDefaults()
	if o.Trials < 1 || len(o.Slowdowns) == 0 {
		return nil, errors.New("at least one trial and one slowdown")
	}
	if len(o.Thresholds) == 0 {
		o.Thresholds = []float64{det.Threshold}
	}
	if o.Onset < 0 || o.Onset >= o.Sim.Steps {
		return nil, fmt.Errorf("onset %d outside the %d steps", o.Onset, o.Sim.Steps)
	}
	var rows []ROCRow
	for si, s := range o.Slowdowns {
		trials := make([]*rocTrial, o.Trials)
		for t := range trials {
			sim := o.Sim
			sim.Seed = o.Sim.Seed + uint64(si)*1_000_003 + uint64(t)*7919
			victim := int(sim.Seed % uint64(sim.Ranks))
			sim.Slow = []Slowdown{{Rank: victim, Factor: s, From: o.Onset}}
			arr, _, err := Simulate(sim)
			if err != nil {
				return nil, err
			}
			tr := newROCTrial(o.Thresholds)
			for _, ws := range ScoreWindows(arr, det) {
				tr.add(o.Thresholds, ws.Rank == victim, ws.Window, ws.Window*det.Window, (ws.Window+1)*det.Window, o.Onset,
					ws.Score, func(th float64) bool { return ws.Score >= th })
			}
			trials[t] = tr
		}
		for _, th := range o.Thresholds {
			rows = append(rows, ROCRow{Schema: ROCSchema, Dist: distName(o.Sim.Dist), Jitter: o.Sim.Jitter, Common: o.Sim.Common,
				Ranks: o.Sim.Ranks, Steps: o.Sim.Steps, Window: det.Window, Slowdown: s, Threshold: th, Trials: o.Trials,
				ROCRates: rocRates(trials, th, o.Onset, det.Window)})
		}
	}
	return rows, nil
}

func distName(d string) string {
	if d == "" {
		return "gaussian"
	}
	return d
}
