package trace

import (
	"math"
	"sort"
)

// StragglerSchema is the schema of gbtrace stragglers' lines.
const StragglerSchema = "gpubridge.trace-straggler/v1"

// StragglerOptions set the detector (docs/STRAGGLERS.md).
type StragglerOptions struct {
	Window    int     // collectives per window (default 100)
	Threshold float64 // score at or above which a rank is flagged (default 5)
	Clip      float64 // lateness is clipped at this many robust SDs (default 3)
}

func (o StragglerOptions) withDefaults() StragglerOptions {
	if o.Window <= 0 {
		o.Window = 100
	}
	if o.Threshold <= 0 {
		o.Threshold = 5
	}
	if o.Clip <= 0 {
		o.Clip = 3
	}
	return o
}

// WindowScore is one rank's score in one window: its mean lateness
// (clipped) over the robust standard error.
type WindowScore struct {
	Window int     // index
	Rank   int     // column index
	Score  float64 // z: mean lateness / (robust SD / sqrt(rows))
	LateNs float64 // mean lateness (not clipped: what the rank cost the others), from the median rank's
	SDNs   float64 // the window's robust SD of one lateness
	Rows   int
}

// ScoreWindows scores every column (rank) of arrivals (rows: collectives
// in order; columns: ranks; times on one clock) over consecutive
// non-overlapping windows of o.Window rows. A rank's lateness in a row is
// its arrival minus the row's median arrival: jitter every rank shares
// cancels, and a rank that computes more slowly arrives late row after
// row. The spread of one lateness is estimated robustly over the whole
// window (1.4826 x the median absolute deviation of every rank's lateness),
// and each lateness is clipped at o.Clip of those, so one long pause (a
// page fault, a preempted thread) does not flag a rank; the score is a
// rank's mean clipped lateness over its standard error, from the clipped
// values' spread around each rank's own mean, pooled over the ranks (so a
// straggler does not hide itself by widening it). A trailing part window of
// fewer than half o.Window rows is not scored.
func ScoreWindows(arrivals [][]float64, o StragglerOptions) []WindowScore {
	o = o.withDefaults()
	if len(arrivals) == 0 {
		return nil
	}
	n := len(arrivals[0])
	late := make([][]float64, len(arrivals))
	row := make([]float64, n)
	for k, a := range arrivals {
		copy(row, a)
		med := median(row)
		late[k] = make([]float64, n)
		for r := range a {
			late[k][r] = a[r] - med
		}
	}
	var out []WindowScore
	pool := make([]float64, 0, o.Window*n)
	for w, lo := 0, 0; lo < len(late); w, lo = w+1, lo+o.Window {
		hi := min(lo+o.Window, len(late))
		if hi-lo < (o.Window+1)/2 {
			break
		}
		pool = pool[:0]
		for k := lo; k < hi; k++ {
			pool = append(pool, late[k]...)
		}
		lim := o.Clip * robustSD(pool)
		rows := hi - lo
		// Each rank's clipped lateness: its mean, and its spread around
		// that mean, pooled over the ranks (a straggler's shift does not
		// widen it; the clipped values' own spread, not the MAD, is what
		// the clipped mean's error comes from, whatever the distribution).
		means := make([]float64, n)
		raw := make([]float64, n) // unclipped, for LateNs
		ss := 0.0
		for r := 0; r < n; r++ {
			sum, rawSum := 0.0, 0.0
			for k := lo; k < hi; k++ {
				sum += clip(late[k][r], lim)
				rawSum += late[k][r]
			}
			means[r] = sum / float64(rows)
			raw[r] = rawSum / float64(rows)
			for k := lo; k < hi; k++ {
				d := clip(late[k][r], lim) - means[r]
				ss += d * d
			}
		}
		sd := math.Sqrt(ss / float64(n*(rows-1)))
		if sd <= 0 || rows < 2 {
			sd = math.SmallestNonzeroFloat64
		}
		// Relative to the median rank: clipping a skewed jitter (lognormal)
		// moves every rank's mean alike.
		center := median(append([]float64(nil), means...))
		rawCenter := median(append([]float64(nil), raw...))
		for r := 0; r < n; r++ {
			out = append(out, WindowScore{Window: w, Rank: r, Score: (means[r] - center) / (sd / math.Sqrt(float64(rows))),
				LateNs: raw[r] - rawCenter, SDNs: sd, Rows: rows})
		}
	}
	return out
}

func clip(x, lim float64) float64 { return math.Max(-lim, math.Min(lim, x)) }

// median of x (reorders x).
func median(x []float64) float64 {
	sort.Float64s(x)
	m := len(x) / 2
	if len(x)%2 == 1 {
		return x[m]
	}
	return (x[m-1] + x[m]) / 2
}

// robustSD is 1.4826 x the median absolute deviation (reorders x).
func robustSD(x []float64) float64 {
	med := median(x)
	for i := range x {
		x[i] = math.Abs(x[i] - med)
	}
	return 1.4826 * median(x)
}

// Confidence is one minus the chance that a rank with no slowdown scores
// at least z in a window, for ranks ranks (Bonferroni), under the Gaussian
// approximation of the window mean.
func Confidence(z float64, ranks int) float64 {
	p := 0.5 * math.Erfc(z/math.Sqrt2) * float64(max(ranks, 1))
	return math.Max(0, 1-p)
}

// Straggler is a rank flagged in one window of one group.
type Straggler struct {
	Schema     string  `json:"schema"`
	Kind       string  `json:"kind"` // "straggler"; "window" with --all
	Group      string  `json:"group"`
	Rank       int     `json:"rank"`
	Window     int     `json:"window"`
	FirstSeq   int64   `json:"first_seq"`
	LastSeq    int64   `json:"last_seq"`
	Rows       int     `json:"collectives"`
	Score      float64 `json:"score"`
	Threshold  float64 `json:"threshold"`
	Confidence float64 `json:"confidence"`
	LateUs     float64 `json:"late_us"` // mean lateness at the call
	SDUs       float64 `json:"sd_us"`
	Phase      string  `json:"phase"` // where the time goes
	Flagged    bool    `json:"flagged"`
	// BridgeWaitedFor is the rank the leaders waited for most at the
	// bridge over the window (gbbridge's per-peer arrival skew), and
	// BridgeWaitUs that wait per collective; absent without bridge parts.
	BridgeWaitedFor *int    `json:"bridge_waited_for,omitempty"`
	BridgeWaitUs    float64 `json:"bridge_wait_us,omitempty"`
}

// StragglerSummary ends gbtrace stragglers' output.
type StragglerSummary struct {
	Schema    string  `json:"schema"`
	Kind      string  `json:"kind"` // "summary"
	Groups    int     `json:"groups"`
	Windows   int     `json:"windows"`
	Ranks     int     `json:"ranks"`
	Flagged   []int   `json:"flagged"` // ranks flagged in any window
	Threshold float64 `json:"threshold"`
	Window    int     `json:"window"`
	Skipped   int     `json:"skipped"` // collectives without every rank's ended record
}

// localPhases are steps a rank does alone (no waiting on a peer inside
// them), so a rank slow in one of them is slow itself.
var localPhases = map[string]bool{"copy": true, "copy back": true}

// Stragglers scores every group of the merged collectives over windows of
// complete collectives (every rank's record, each ended): from arrival
// lateness (phase "before the call", or the user phase, marked with
// gpubridge.observe.phase, in which the rank spends the most extra time),
// and from the local phases (copy, copy back) a rank is slower in. all:
// every rank-window, not only the flagged ones.
func Stragglers(merged []Merged, phases []UserPhase, o StragglerOptions, all bool) ([]Straggler, StragglerSummary) {
	o = o.withDefaults()
	sum := StragglerSummary{Schema: StragglerSchema, Kind: "summary", Threshold: o.Threshold, Window: o.Window, Flagged: []int{}}
	byGroup := map[string][]*Merged{}
	var names []string
	for i := range merged {
		m := &merged[i]
		if !m.Complete || m.Size < 2 {
			sum.Skipped++
			continue
		}
		if byGroup[m.Group] == nil {
			names = append(names, m.Group)
		}
		byGroup[m.Group] = append(byGroup[m.Group], m)
	}
	sort.Strings(names)
	flagged := map[int]bool{}
	var out []Straggler
	for _, g := range names {
		rows := byGroup[g]
		sum.Groups++
		ranks := make([]int, len(rows[0].Ranks))
		for i, v := range rows[0].Ranks {
			ranks[i] = v.Rank
		}
		sum.Ranks = max(sum.Ranks, len(ranks))
		arr := make([][]float64, len(rows))
		for k, m := range rows {
			arr[k] = make([]float64, len(ranks))
			for i, v := range m.Ranks {
				arr[k][i] = float64(v.Arrived)
			}
		}
		scores := ScoreWindows(arr, o)
		local := localScores(rows, ranks, o)
		windows := map[int]bool{}
		for i, s := range scores {
			windows[s.Window] = true
			lo, hi := s.Window*o.Window, min((s.Window+1)*o.Window, len(rows))-1
			st := Straggler{Schema: StragglerSchema, Kind: "window", Group: g, Rank: ranks[s.Rank], Window: s.Window,
				FirstSeq: rows[lo].Seq, LastSeq: rows[hi].Seq, Rows: s.Rows, Score: round3(s.Score), Threshold: o.Threshold,
				Confidence: round6(Confidence(s.Score, len(ranks))), LateUs: round3(s.LateNs / 1e3), SDUs: round3(s.SDNs / 1e3),
				Phase: "before the call"}
			if name := userPhase(phases, ranks[s.Rank], ranks, rows[lo:hi+1]); name != "" {
				st.Phase = name
			}
			if l, ok := local[i]; ok && l.score > st.Score {
				st.Score, st.Phase = round3(l.score), l.phase
				st.Confidence = round6(Confidence(l.score, len(ranks)))
			}
			st.BridgeWaitedFor, st.BridgeWaitUs = bridgeWait(rows[lo : hi+1])
			st.Flagged = st.Score >= o.Threshold
			if st.Flagged {
				st.Kind = "straggler"
				flagged[st.Rank] = true
			}
			if st.Flagged || all {
				out = append(out, st)
			}
		}
		sum.Windows += len(windows)
	}
	for r := range flagged {
		sum.Flagged = append(sum.Flagged, r)
	}
	sort.Ints(sum.Flagged)
	return out, sum
}

type localScore struct {
	score float64
	phase string
}

// localScores: for each (window, rank) score index, the best score of the
// rank's excess time in a local phase, among the ranks that have that
// phase in every collective (leaders copy, the others do not); a phase
// fewer than 3 ranks have is not compared.
func localScores(rows []*Merged, ranks []int, o StragglerOptions) map[int]localScore {
	names := map[string]bool{}
	for _, m := range rows {
		for _, v := range m.Ranks {
			for _, p := range v.Phases {
				if localPhases[p.Name] {
					names[p.Name] = true
				}
			}
		}
	}
	out := map[int]localScore{}
	for name := range names {
		dur := make([][]float64, len(rows))
		has := make([]int, len(ranks))
		for k, m := range rows {
			dur[k] = make([]float64, len(ranks))
			for i, v := range m.Ranks {
				found := false
				for _, p := range v.Phases {
					if p.Name == name && p.End != nil {
						dur[k][i] += float64(*p.End - p.Start)
						found = true
					}
				}
				if found {
					has[i]++
				}
			}
		}
		var cols []int
		for i, n := range has {
			if n == len(rows) {
				cols = append(cols, i)
			}
		}
		if len(cols) < 3 {
			continue
		}
		sub := make([][]float64, len(rows))
		for k := range dur {
			sub[k] = make([]float64, len(cols))
			for j, i := range cols {
				sub[k][j] = dur[k][i]
			}
		}
		for _, s := range ScoreWindows(sub, o) {
			idx := s.Window*len(ranks) + cols[s.Rank]
			if s.Score > out[idx].score {
				out[idx] = localScore{s.Score, name}
			}
		}
	}
	return out
}

// userPhase: the user phase in which rank spent the most more than the
// median rank over the window's time span, if any.
func userPhase(phases []UserPhase, rank int, ranks []int, rows []*Merged) string {
	if len(phases) == 0 {
		return ""
	}
	lo, hi := rows[0].FirstArrival, rows[len(rows)-1].LastArrival
	totals := map[string]map[int]float64{}
	for _, p := range phases {
		if p.End < lo || p.Start > hi {
			continue
		}
		if totals[p.Name] == nil {
			totals[p.Name] = map[int]float64{}
		}
		totals[p.Name][p.Rank] += float64(p.End - p.Start)
	}
	best, bestName := 0.0, ""
	for name, t := range totals {
		vals := make([]float64, len(ranks))
		for i, r := range ranks {
			vals[i] = t[r]
		}
		excess := t[rank] - median(vals)
		if excess > best || (excess == best && name < bestName && bestName != "") {
			best, bestName = excess, name
		}
	}
	return bestName
}

func round6(x float64) float64 { return math.Round(x*1e6) / 1e6 }

// bridgeWait: the rank whose lateness at the bridge the leaders waited
// for longest in total over rows, and that total per collective (µs).
func bridgeWait(rows []*Merged) (*int, float64) {
	total := map[int]int64{}
	for _, m := range rows {
		if m.BridgeWaitedFor != nil {
			total[*m.BridgeWaitedFor] += m.BridgeWaitNs
		}
	}
	best, bestNs := -1, int64(0)
	for r, ns := range total {
		if ns > bestNs || ns == bestNs && r < best {
			best, bestNs = r, ns
		}
	}
	if best < 0 {
		return nil, 0
	}
	return &best, round3(float64(bestNs) / float64(len(rows)) / 1e3)
}
