package main

// serveBallast is the size of serve's GC ballast: an allocation that is
// never written, so it costs address space but no memory (a large
// object's fresh pages are not touched), and raises the heap goal by
// twice its size. serve's live heap is a few MiB and each collective
// allocates a few KiB (calls, contexts, timers); with the default goal the
// collector ran about every 30 ms under back-to-back 4-byte all_reduces
// on the 16-core H200 host, each cycle about 0.7 ms with stop-the-world
// pauses, on about one call in 75: the p99 of the tiny call
// (docs/BENCHMARKS.md). With the ballast a cycle comes about every 1,400
// such calls. It adds to the goal rather than multiplying it (as a higher
// GOGC would), so a large live heap (error-feedback residuals) still
// grows by the usual factor.
const serveBallast = 64 << 20

// gcBallast keeps the ballast reachable for the life of the process.
var gcBallast []byte

// setGCBallast allocates the ballast unless the user tunes the collector
// (GOGC or GOMEMLIMIT set), and returns its size.
func setGCBallast(getenv func(string) string) int {
	if getenv("GOGC") != "" || getenv("GOMEMLIMIT") != "" {
		return 0
	}
	gcBallast = make([]byte, serveBallast)
	return len(gcBallast)
}
