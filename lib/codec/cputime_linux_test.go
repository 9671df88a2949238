package codec

import (
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU is the CPU time of the calling thread (the benchmarks lock
// their goroutine to it): a per-core figure that a loaded machine's other
// work does not dilute.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}
