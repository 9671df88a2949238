package trace

import (
	"math"
	"math/bits"
	"sort"
)

// SummarySchema is the schema of gbtrace summary's lines.
const SummarySchema = "gpubridge.trace-summary/v1"

// SummaryRow is one op and size bucket of one group size.
type SummaryRow struct {
	Schema    string             `json:"schema"`
	Op        string             `json:"op"`
	GroupSize int                `json:"group_size"`
	Bucket    int64              `json:"bucket"` // sizes in (bucket/2, bucket] bytes
	Label     string             `json:"bucket_label"`
	Count     int                `json:"count"`  // collectives whose every rank ended ok
	Failed    int                `json:"failed"` // with a rank that failed or never ended
	Bytes     int64              `json:"bytes"`  // the median size
	P50Us     float64            `json:"time_p50_us"`
	P99Us     float64            `json:"time_p99_us"`
	AlgBW     float64            `json:"algbw_gbps"`  // median bytes / median time
	BusBW     float64            `json:"busbw_gbps"`  // algbw × nccl-tests' factor for the op
	WaitP50Us float64            `json:"wait_p50_us"` // first to last arrival (skew)
	Phases    map[string]float64 `json:"phases"`      // each phase's share of the ranks' time in the collective
}

// BusFactor is nccl-tests' bus bandwidth factor: busbw = algbw × factor,
// for n ranks (PERFORMANCE.md of nccl-tests): all_reduce 2(n-1)/n,
// all_gather and reduce_scatter (n-1)/n, all_to_all (n-1)/n, broadcast,
// reduce and the rest 1; barrier moves no data (0).
func BusFactor(op string, n int) float64 {
	if n < 1 {
		return 0
	}
	f := float64(n-1) / float64(n)
	switch op {
	case "all_reduce":
		return 2 * f
	case "all_gather", "reduce_scatter", "all_to_all":
		return f
	case "barrier":
		return 0
	}
	return 1
}

// Bucket is the smallest power of two at least n (1 for 0).
func Bucket(n int64) int64 {
	if n <= 1 {
		return 1
	}
	return 1 << (64 - bits.LeadingZeros64(uint64(n-1)))
}

// Human writes a size as 4K, 64M, 1G.
func Human(n int64) string {
	units := []string{"", "K", "M", "G", "T", "P"}
	i := 0
	for n >= 1024 && n%1024 == 0 && i < len(units)-1 {
		n /= 1024
		i++
	}
	return itoa(n) + units[i]
}

func itoa(n int64) string {
	if n == 0 {
		return "0"
	}
	neg := n < 0
	if neg {
		n = -n
	}
	var b [20]byte
	i := len(b)
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	if neg {
		i--
		b[i] = '-'
	}
	return string(b[i:])
}

// Quantile is the nearest-rank q-quantile of sorted values.
func Quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

type sumKey struct {
	op     string
	size   int
	bucket int64
}

// Summarize groups the merged collectives by op, group size and size
// bucket. A collective's time is from the last rank's arrival to the last
// rank's end: what the collective itself took once everyone was there
// (waiting for a late rank is the skew, apart).
func Summarize(m []Merged) []SummaryRow {
	type acc struct {
		times, waits []float64
		bytes        []int64
		phase        map[string]float64
		total        float64
		failed       int
	}
	accs := map[sumKey]*acc{}
	for i := range m {
		c := &m[i]
		k := sumKey{c.Op, c.Size, Bucket(c.Bytes)}
		a := accs[k]
		if a == nil {
			a = &acc{phase: map[string]float64{}}
			accs[k] = a
		}
		ok := c.TimeNs != nil && c.Seen > 0
		for _, v := range c.Ranks {
			ok = ok && v.Result == ResultOK
		}
		if !ok {
			a.failed++
			continue
		}
		a.times = append(a.times, float64(*c.TimeNs))
		a.waits = append(a.waits, float64(c.SkewNs))
		a.bytes = append(a.bytes, c.Bytes)
		for _, v := range c.Ranks {
			a.total += float64(*v.End - v.Arrived)
			for _, p := range v.Phases {
				if p.End != nil {
					a.phase[p.Name] += float64(*p.End - p.Start)
				}
			}
		}
	}
	keys := make([]sumKey, 0, len(accs))
	for k := range accs {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		if a.op != b.op {
			return a.op < b.op
		}
		if a.size != b.size {
			return a.size < b.size
		}
		return a.bucket < b.bucket
	})
	var out []SummaryRow
	for _, k := range keys {
		a := accs[k]
		row := SummaryRow{Schema: SummarySchema, Op: k.op, GroupSize: k.size, Bucket: k.bucket, Label: Human(k.bucket),
			Count: len(a.times), Failed: a.failed, Phases: map[string]float64{}}
		if len(a.times) > 0 {
			sort.Float64s(a.times)
			sort.Float64s(a.waits)
			sort.Slice(a.bytes, func(i, j int) bool { return a.bytes[i] < a.bytes[j] })
			row.Bytes = a.bytes[(len(a.bytes)-1)/2]
			p50 := Quantile(a.times, 0.5)
			row.P50Us, row.P99Us = round3(p50/1e3), round3(Quantile(a.times, 0.99)/1e3)
			row.WaitP50Us = round3(Quantile(a.waits, 0.5) / 1e3)
			if p50 > 0 && k.op != "barrier" {
				row.AlgBW = round3(float64(row.Bytes) / p50) // bytes per ns = GB/s
				row.BusBW = round3(row.AlgBW * BusFactor(k.op, k.size))
			}
			for name, t := range a.phase {
				if a.total > 0 {
					row.Phases[name] = round3(t / a.total)
				}
			}
		}
		out = append(out, row)
	}
	return out
}

func round3(x float64) float64 { return math.Round(x*1000) / 1000 }

func sortFloats(x []float64) { sort.Float64s(x) }
