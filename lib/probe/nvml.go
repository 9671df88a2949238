package probe

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// NVML is the part of the NVIDIA Management Library the probe uses. The real
// one (RealNVML) loads libnvidia-ml.so.1 at run time through go-nvml; tests
// inject fakes through Options.NVMLLib.
type NVML interface {
	// Query initialises NVML, reads the system's and every device's facts,
	// and shuts NVML down. An error wrapping ErrNVMLUnavailable means the
	// library or driver is absent (a fact, not a fault, on a node without
	// NVIDIA GPUs); any other error is a fault.
	Query() (*NVMLInfo, error)
}

// NVMLInfo is what NVML said.
type NVMLInfo struct {
	DriverVersion     string
	CUDADriverVersion string // "12.4"
	// GPUs have Vendor nvidia, Source nvml, and the driver versions filled in.
	GPUs []GPU
	// Warnings are partial failures (a device whose PCI info could not be
	// read); the probe reports them as problems.
	Warnings []string
}

// ErrNVMLUnavailable is wrapped by NVML errors that mean "no usable NVML
// here": the library cannot be loaded or the kernel driver is not loaded.
var ErrNVMLUnavailable = errors.New("NVML unavailable")

// NVMLFunc adapts a function to the NVML interface.
type NVMLFunc func() (*NVMLInfo, error)

// Query calls f.
func (f NVMLFunc) Query() (*NVMLInfo, error) { return f() }

// queryNVML runs lib.Query bounded by timeout and ctx: a broken driver can
// hang nvmlInit forever, and then the goroutine is abandoned (the process
// is short-lived) and the status says so.
func queryNVML(ctx context.Context, lib NVML, timeout time.Duration) (*NVMLInfo, NVMLStatus) {
	type result struct {
		info *NVMLInfo
		err  error
	}
	done := make(chan result, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- result{err: fmt.Errorf("query panicked: %v", r)}
			}
		}()
		info, err := lib.Query()
		done <- result{info, err}
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case r := <-done:
		switch {
		case r.err == nil && r.info == nil:
			return nil, NVMLStatus{State: NVMLError, Error: "query returned nothing"}
		case r.err == nil:
			return r.info, NVMLStatus{State: NVMLOK, DriverVersion: r.info.DriverVersion, CUDADriverVersion: r.info.CUDADriverVersion}
		case errors.Is(r.err, ErrNVMLUnavailable):
			// The state says "unavailable"; keep the cause only.
			msg := strings.TrimPrefix(r.err.Error(), ErrNVMLUnavailable.Error()+": ")
			return nil, NVMLStatus{State: NVMLUnavailable, Error: msg}
		default:
			return nil, NVMLStatus{State: NVMLError, Error: r.err.Error()}
		}
	case <-timer.C:
		return nil, NVMLStatus{State: NVMLTimeout, Error: fmt.Sprintf("init timed out after %s", timeout)}
	case <-ctx.Done():
		return nil, NVMLStatus{State: NVMLTimeout, Error: fmt.Sprintf("query abandoned: %v", ctx.Err())}
	}
}

// cudaVersion formats NVML's CUDA driver version, 12040 -> "12.4".
func cudaVersion(v int) string {
	if v <= 0 {
		return ""
	}
	return fmt.Sprintf("%d.%d", v/1000, v%1000/10)
}
