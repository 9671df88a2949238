//go:build !cgo || !linux

package probe

import "fmt"

// DefaultNVMLLibrary is the library RealNVML loads when given no path.
const DefaultNVMLLibrary = "libnvidia-ml.so.1"

// RealNVML returns an NVML that is always unavailable: this binary was built
// without cgo (or not for Linux), and go-nvml needs cgo to dlopen the library.
func RealNVML(path string) NVML {
	return NVMLFunc(func() (*NVMLInfo, error) {
		return nil, fmt.Errorf("%w: gbprobe was built without cgo, so it cannot load NVML", ErrNVMLUnavailable)
	})
}
