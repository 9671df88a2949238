package probe

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

func TestQueryNVMLOutcomes(t *testing.T) {
	info := &NVMLInfo{DriverVersion: "550.54.15", CUDADriverVersion: "12.4"}
	// The answering fakes get a deadline for hangs only (scaled on a loaded
	// machine); the hanging one's 30 ms is what the case checks.
	wait := testenv.Scale(5 * time.Second)
	tests := []struct {
		name    string
		lib     NVML
		timeout time.Duration
		want    NVMLStatus
	}{
		{"ok", NVMLFunc(func() (*NVMLInfo, error) { return info, nil }), wait,
			NVMLStatus{State: NVMLOK, DriverVersion: "550.54.15", CUDADriverVersion: "12.4"}},
		{"unavailable", NVMLFunc(func() (*NVMLInfo, error) {
			return nil, fmt.Errorf("%w: nvmlInit: ERROR_DRIVER_NOT_LOADED (9)", ErrNVMLUnavailable)
		}), wait, NVMLStatus{State: NVMLUnavailable, Error: "nvmlInit: ERROR_DRIVER_NOT_LOADED (9)"}},
		{"error", NVMLFunc(func() (*NVMLInfo, error) { return nil, errors.New("nvmlDeviceGetCount: ERROR_UNKNOWN (999)") }), wait,
			NVMLStatus{State: NVMLError, Error: "nvmlDeviceGetCount: ERROR_UNKNOWN (999)"}},
		{"nil info", NVMLFunc(func() (*NVMLInfo, error) { return nil, nil }), wait,
			NVMLStatus{State: NVMLError, Error: "query returned nothing"}},
		{"panic", NVMLFunc(func() (*NVMLInfo, error) { panic("boom") }), wait,
			NVMLStatus{State: NVMLError, Error: "query panicked: boom"}},
		{"hang", nvmlHangs(t), 30 * time.Millisecond,
			NVMLStatus{State: NVMLTimeout, Error: "init timed out after 30ms"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			_, st := queryNVML(context.Background(), tc.lib, tc.timeout)
			assert.Equal(t, tc.want, st)
			assert.Less(t, time.Since(start), tc.timeout+testenv.Scale(time.Second))
		})
	}
}

func TestQueryNVMLHonoursContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, st := queryNVML(ctx, nvmlHangs(t), time.Hour)
	assert.Equal(t, NVMLTimeout, st.State)
	assert.Contains(t, st.Error, "context canceled")
}

// TestRealNVMLAbsent runs the real go-nvml path on a node without the
// library (this machine, and CI): it must say unavailable, not crash.
func TestRealNVMLAbsent(t *testing.T) {
	if _, err := os.Stat("/dev/nvidiactl"); err == nil {
		t.Skip("this node has an NVIDIA driver; the absent path cannot be tested here")
	}
	missing := filepath.Join(t.TempDir(), "libnvidia-ml.so.1")
	for _, path := range []string{missing, ""} {
		info, st := queryNVML(context.Background(), RealNVML(path), testenv.Scale(5*time.Second))
		if path == "" && st.State == NVMLOK {
			t.Skip("libnvidia-ml.so.1 is installed here")
		}
		assert.Nil(t, info)
		assert.Equal(t, NVMLUnavailable, st.State, "path %q: %+v", path, st)
		assert.NotEmpty(t, st.Error)
		if path != "" {
			assert.Contains(t, st.Error, missing)
		}
	}

	// The whole probe on the real sysfs with the real NVML: no crash, NVML
	// is a fact, not a problem (no NVIDIA PCI device here).
	rep, err := Run(context.Background(), Options{NVML: NVMLModeOn, NVMLLibrary: missing, NoNICs: true})
	require.NoError(t, err)
	assert.Equal(t, NVMLUnavailable, rep.NVML.State)
	res := rep.Check(mustParse(t, "nvml"))
	assert.False(t, res[0].OK)
	assert.Contains(t, res[0].Reason, "NVML unavailable: "+missing)
}
