//go:build cgo && linux

package probe

import (
	"errors"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func busID(s string) [32]int8 {
	var b [32]int8
	for i := range len(s) {
		b[i] = int8(s[i])
	}
	return b
}

func mockDevice(index int, bus string, pci nvml.PciInfo) *mock.Device {
	pci.BusId = busID(bus)
	return &mock.Device{
		GetIndexFunc:                 func() (int, nvml.Return) { return index, nvml.SUCCESS },
		GetNameFunc:                  func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
		GetUUIDFunc:                  func() (string, nvml.Return) { return "GPU-" + bus, nvml.SUCCESS },
		GetPciInfoFunc:               func() (nvml.PciInfo, nvml.Return) { return pci, nvml.SUCCESS },
		GetMemoryInfoFunc:            func() (nvml.Memory, nvml.Return) { return nvml.Memory{Total: 85520809984}, nvml.SUCCESS },
		GetCudaComputeCapabilityFunc: func() (int, int, nvml.Return) { return 9, 0, nvml.SUCCESS },
	}
}

func mockLib(init nvml.Return, devs ...nvml.Device) *mock.Interface {
	return &mock.Interface{
		InitFunc:                       func() nvml.Return { return init },
		ShutdownFunc:                   func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:                func(r nvml.Return) string { return r.Error() },
		SystemGetDriverVersionFunc:     func() (string, nvml.Return) { return "550.54.15", nvml.SUCCESS },
		SystemGetCudaDriverVersionFunc: func() (int, nvml.Return) { return 12040, nvml.SUCCESS },
		DeviceGetCountFunc:             func() (int, nvml.Return) { return len(devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return devs[i], nvml.SUCCESS
		},
	}
}

// TestQueryGoNVML runs the go-nvml mapping against go-nvml's own mock.
func TestQueryGoNVML(t *testing.T) {
	lib := mockLib(nvml.SUCCESS,
		mockDevice(0, "00000000:3B:00.0", nvml.PciInfo{PciDeviceId: 0x233010de}),
		mockDevice(1, "", nvml.PciInfo{Domain: 0, Bus: 0x86, Device: 0, PciDeviceId: 0x233010de}))
	info, err := queryGoNVML(lib)
	require.NoError(t, err)
	assert.Equal(t, "550.54.15", info.DriverVersion)
	assert.Equal(t, "12.4", info.CUDADriverVersion)
	require.Len(t, info.GPUs, 2)
	assert.Equal(t, GPU{Vendor: VendorNVIDIA, Index: 0, Name: "NVIDIA H100 80GB HBM3", UUID: "GPU-00000000:3B:00.0",
		PCIBusID: "0000:3b:00.0", DeviceID: "0x2330", MemoryBytes: 85520809984, DriverVersion: "550.54.15",
		CUDADriverVersion: "12.4", ComputeCapability: "9.0", Source: "nvml"}, info.GPUs[0])
	assert.Equal(t, "0000:86:00.0", info.GPUs[1].PCIBusID)
	assert.Len(t, lib.ShutdownCalls(), 1)
}

func TestQueryGoNVMLInitFailures(t *testing.T) {
	tests := []struct {
		ret         nvml.Return
		unavailable bool
	}{
		{nvml.ERROR_LIBRARY_NOT_FOUND, true},
		{nvml.ERROR_DRIVER_NOT_LOADED, true},
		{nvml.ERROR_NO_PERMISSION, false},
		{nvml.ERROR_LIB_RM_VERSION_MISMATCH, false},
	}
	for _, tc := range tests {
		t.Run(tc.ret.Error(), func(t *testing.T) {
			lib := mockLib(tc.ret)
			_, err := queryGoNVML(lib)
			require.Error(t, err)
			assert.Equal(t, tc.unavailable, errors.Is(err, ErrNVMLUnavailable), err.Error())
			assert.Contains(t, err.Error(), "nvmlInit: "+tc.ret.Error())
			assert.Empty(t, lib.ShutdownCalls(), "no shutdown after a failed init")
		})
	}
}

func TestQueryGoNVMLPartialDevice(t *testing.T) {
	bad := mockDevice(1, "00000000:86:00.0", nvml.PciInfo{})
	bad.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{}, nvml.ERROR_GPU_IS_LOST }
	lib := mockLib(nvml.SUCCESS, mockDevice(0, "00000000:3B:00.0", nvml.PciInfo{}), bad)
	info, err := queryGoNVML(lib)
	require.NoError(t, err)
	assert.Len(t, info.GPUs, 2)
	require.Len(t, info.Warnings, 1)
	assert.Contains(t, info.Warnings[0], "device 1: PCI info: ERROR_GPU_IS_LOST")
}
