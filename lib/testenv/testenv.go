// Package testenv holds what the project's tests share about the machine
// they run on. Deadlines in tests are there to catch hangs, not to time
// anything: Scale stretches them on a slow or loaded machine.
package testenv

import (
	"os"
	"strconv"
	"time"
)

// ScaleVar multiplies every test deadline that goes through Scale (default
// 1; for example 3 under valgrind or on an overloaded runner).
const ScaleVar = "GPUBRIDGE_TEST_TIMEOUT_SCALE"

// Factor is the value of ScaleVar, 1 when unset or not a number >= 1.
func Factor() float64 {
	f, err := strconv.ParseFloat(os.Getenv(ScaleVar), 64)
	if err != nil || f < 1 {
		return 1
	}
	return f
}

// Scale returns d times Factor().
func Scale(d time.Duration) time.Duration {
	return time.Duration(float64(d) * Factor())
}
