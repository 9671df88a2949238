package trace

// ROCRates are what a ROC row says of one slowdown at one threshold,
// whichever detector: how often and how soon the slowed rank was flagged,
// and how often a clean rank-window was.
type ROCRates struct {
	Detected1     float64 `json:"detected_first_window"` // share of trials flagged in the first window after the onset
	Detected      float64 `json:"detected"`              // share flagged in any window after the onset
	DelayP50      float64 `json:"delay_steps_p50"`       // steps from the onset to the end of the first flagged window
	DelayP99      float64 `json:"delay_steps_p99"`
	CleanWindows  int     `json:"clean_rank_windows"`
	FalseFlags    int     `json:"false_flags"`
	FalseRate     float64 `json:"false_rate"`
	SlowScoreMean float64 `json:"slow_score_mean"` // the slowed rank's mean score after the onset
}

// rocTrial counts one trial's rank-windows.
type rocTrial struct {
	first   map[float64]int // threshold -> the first flagged window after the onset (-1: none)
	falses  map[float64]int
	clean   int
	slowSum float64
	slowN   int
}

func newROCTrial(thresholds []float64) *rocTrial {
	t := &rocTrial{first: map[float64]int{}, falses: map[float64]int{}}
	for _, th := range thresholds {
		t.first[th] = -1
	}
	return t
}

// add counts a rank-window covering steps [lo, hi) of the victim or of
// another rank: a clean one (another rank's, or the victim's before the
// onset) flagged is a false flag; the victim's after the onset flagged is
// a detection. flagged: whether the window is flagged at a threshold.
func (t *rocTrial) add(thresholds []float64, victim bool, window, lo, hi, onset int, score float64, flagged func(th float64) bool) {
	after := lo >= onset
	clean := !victim || hi <= onset
	if clean {
		t.clean++
	}
	if victim && after {
		t.slowSum += score
		t.slowN++
	}
	for _, th := range thresholds {
		if !flagged(th) {
			continue
		}
		if clean {
			t.falses[th]++
		} else if victim && after && (t.first[th] < 0 || window < t.first[th]) {
			t.first[th] = window
		}
	}
}

// rocRates sums the trials at one threshold.
func rocRates(trials []*rocTrial, th float64, onset, window int) ROCRates {
	var r ROCRates
	var delays []float64
	first := (onset + window - 1) / window // the first window wholly after the onset
	slowSum, slowN := 0.0, 0
	for _, tr := range trials {
		r.CleanWindows += tr.clean
		r.FalseFlags += tr.falses[th]
		slowSum += tr.slowSum
		slowN += tr.slowN
		if w := tr.first[th]; w >= 0 {
			r.Detected++
			if w == first {
				r.Detected1++
			}
			delays = append(delays, float64((w+1)*window-onset))
		}
	}
	r.Detected = round6(r.Detected / float64(len(trials)))
	r.Detected1 = round6(r.Detected1 / float64(len(trials)))
	if r.CleanWindows > 0 {
		r.FalseRate = float64(r.FalseFlags) / float64(r.CleanWindows)
	}
	if len(delays) > 0 {
		sortFloats(delays)
		r.DelayP50, r.DelayP99 = Quantile(delays, 0.5), Quantile(delays, 0.99)
	}
	if slowN > 0 {
		r.SlowScoreMean = round3(slowSum / float64(slowN))
	}
	return r
}
