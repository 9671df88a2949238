package probe

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func identityReport() *Report {
	r := &Report{Vendor: VendorNVIDIA}
	for i, bus := range []string{"0000:1b:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"} {
		r.GPUs = append(r.GPUs, GPU{Vendor: VendorNVIDIA, Index: i, PCIBusID: bus, UUID: "GPU-" + string(rune('a'+i)) + "000-1111"})
	}
	for i, bus := range []string{"0000:23:00.0", "0000:03:00.0", "0000:43:00.0"} {
		r.GPUs = append(r.GPUs, GPU{Vendor: VendorAMD, Index: i, PCIBusID: bus, UUID: "GPU-6ea6b16ce1e5a00" + string(rune('1'+i))})
	}
	return r
}

func TestVisibleGPUs(t *testing.T) {
	r := identityReport()
	tests := []struct {
		name   string
		vendor string
		env    map[string]string
		want   []string // PCI addresses
	}{
		{"nvidia all", VendorNVIDIA, nil, []string{"0000:1b:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"}},
		{"nvidia indices", VendorNVIDIA, map[string]string{"CUDA_VISIBLE_DEVICES": "2,0"}, []string{"0000:86:00.0", "0000:1b:00.0"}},
		{"nvidia uuid prefix", VendorNVIDIA, map[string]string{"CUDA_VISIBLE_DEVICES": "GPU-d,GPU-b000"}, []string{"0000:af:00.0", "0000:3b:00.0"}},
		{"nvidia invalid ends list", VendorNVIDIA, map[string]string{"CUDA_VISIBLE_DEVICES": "1,7,0"}, []string{"0000:3b:00.0"}},
		{"nvidia ambiguous uuid ends list", VendorNVIDIA, map[string]string{"CUDA_VISIBLE_DEVICES": "GPU-"}, []string{}},
		{"nvidia empty hides all", VendorNVIDIA, map[string]string{"CUDA_VISIBLE_DEVICES": ""}, []string{}},
		{"nvidia MIG unsupported", VendorNVIDIA, map[string]string{"CUDA_VISIBLE_DEVICES": "MIG-1234"}, []string{}},
		{"amd all in KFD order", VendorAMD, nil, []string{"0000:23:00.0", "0000:03:00.0", "0000:43:00.0"}},
		{"amd rocr", VendorAMD, map[string]string{"ROCR_VISIBLE_DEVICES": "2,1"}, []string{"0000:43:00.0", "0000:03:00.0"}},
		{"amd rocr uuid", VendorAMD, map[string]string{"ROCR_VISIBLE_DEVICES": "GPU-6ea6b16ce1e5a003"}, []string{"0000:43:00.0"}},
		{"amd rocr then hip", VendorAMD, map[string]string{"ROCR_VISIBLE_DEVICES": "2,1", "HIP_VISIBLE_DEVICES": "1"}, []string{"0000:03:00.0"}},
		{"amd cuda when no hip", VendorAMD, map[string]string{"CUDA_VISIBLE_DEVICES": "2"}, []string{"0000:43:00.0"}},
		{"amd hip wins over cuda", VendorAMD, map[string]string{"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "2"}, []string{"0000:23:00.0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := []string{}
			for _, g := range r.VisibleGPUs(tc.vendor, envOf(tc.env)) {
				got = append(got, g.PCIBusID)
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestDeviceForAndGPUIdentity(t *testing.T) {
	r := identityReport()
	g, err := r.DeviceFor(VendorNVIDIA, 1, func(k string) string {
		return map[string]string{"CUDA_VISIBLE_DEVICES": "3,2"}[k]
	})
	require.NoError(t, err)
	assert.Equal(t, "0000:86:00.0", g.PCIBusID)

	_, err = r.DeviceFor(VendorAMD, 3, func(string) string { return "" })
	assert.EqualError(t, err, "no amd GPU for local rank 3: 3 visible (3 found on the node)")
	_, err = r.DeviceFor(VendorNVIDIA, 2, func(k string) string {
		return map[string]string{"CUDA_VISIBLE_DEVICES": "0,1"}[k]
	})
	assert.EqualError(t, err, `no nvidia GPU for local rank 2: 2 visible (4 found on the node) with CUDA_VISIBLE_DEVICES="0,1"`)
	_, err = r.DeviceFor(VendorNone, 0, func(string) string { return "" })
	assert.Error(t, err)

	t.Setenv("CUDA_VISIBLE_DEVICES", "1")
	uuid, pci := r.GPUIdentity(0)
	assert.Equal(t, "GPU-b000-1111", uuid)
	assert.Equal(t, "0000:3b:00.0", pci)
	uuid, pci = r.GPUIdentity(1)
	assert.Empty(t, uuid+pci)

	r.Vendor = VendorMixed
	uuid, pci = r.GPUIdentity(0)
	assert.Empty(t, uuid+pci)
}
