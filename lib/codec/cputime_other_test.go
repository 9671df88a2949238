//go:build !linux

package codec

import "time"

// threadCPU is unknown here: the benchmarks report wall time only.
func threadCPU() time.Duration { return 0 }
