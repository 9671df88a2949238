//go:build !cgo || !linux

package transport

import (
	"fmt"

	"github.com/gpubridge/gpubridge/lib/ibverbs"
)

// openVerbsHW fails: without cgo there is no libibverbs.
func openVerbsHW(string, int) (vDev, error) {
	return nil, fmt.Errorf("%w: this gpubridge was built without cgo", ibverbs.ErrUnavailable)
}
