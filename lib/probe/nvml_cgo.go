//go:build cgo && linux

package probe

import (
	"errors"
	"fmt"
	"sort"

	"github.com/NVIDIA/go-nvml/pkg/dl"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// DefaultNVMLLibrary is the library RealNVML loads when given no path.
const DefaultNVMLLibrary = "libnvidia-ml.so.1"

// RealNVML returns the NVML of this node, loaded with dlopen when queried:
// path is the library ("" for libnvidia-ml.so.1 on the loader's path). A
// node without the library answers ErrNVMLUnavailable; nothing crashes.
func RealNVML(path string) NVML {
	if path == "" {
		path = DefaultNVMLLibrary
	}
	return NVMLFunc(func() (*NVMLInfo, error) {
		// go-nvml turns a failed dlopen into ERROR_LIBRARY_NOT_FOUND and
		// drops dlerror's text; open it once here to keep the reason.
		lib := dl.New(path, dl.RTLD_LAZY|dl.RTLD_GLOBAL)
		if err := lib.Open(); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrNVMLUnavailable, err)
		}
		defer func() { _ = lib.Close() }()
		return queryGoNVML(nvml.New(nvml.WithLibraryPath(path)))
	})
}

// queryGoNVML reads the facts through a go-nvml interface (the real library
// or go-nvml's mock).
func queryGoNVML(lib nvml.Interface) (*NVMLInfo, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		err := fmt.Errorf("nvmlInit: %s", nvmlError(lib, ret))
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND || ret == nvml.ERROR_DRIVER_NOT_LOADED {
			err = fmt.Errorf("%w: %v", ErrNVMLUnavailable, err)
		}
		return nil, err
	}
	defer lib.Shutdown()

	info := &NVMLInfo{GPUs: []GPU{}}
	var errs []error
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		info.DriverVersion = v
	} else {
		errs = append(errs, fmt.Errorf("driver version: %s", nvmlError(lib, ret)))
	}
	if v, ret := lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS {
		info.CUDADriverVersion = cudaVersion(v)
	} else {
		errs = append(errs, fmt.Errorf("CUDA driver version: %s", nvmlError(lib, ret)))
	}
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvmlDeviceGetCount: %s", nvmlError(lib, ret))
	}
	for i := range n {
		dev, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("device %d: handle: %s", i, nvmlError(lib, ret)))
			continue
		}
		g := GPU{Vendor: VendorNVIDIA, Index: i, Source: "nvml",
			DriverVersion: info.DriverVersion, CUDADriverVersion: info.CUDADriverVersion}
		if idx, ret := dev.GetIndex(); ret == nvml.SUCCESS {
			g.Index = idx
		}
		if v, ret := dev.GetName(); ret == nvml.SUCCESS {
			g.Name = v
		}
		if v, ret := dev.GetUUID(); ret == nvml.SUCCESS {
			g.UUID = v
		}
		if p, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			g.PCIBusID = nvmlBusID(p)
			if p.PciDeviceId != 0 {
				g.DeviceID = fmt.Sprintf("0x%04x", p.PciDeviceId>>16)
			}
		} else {
			errs = append(errs, fmt.Errorf("device %d: PCI info: %s", i, nvmlError(lib, ret)))
		}
		if m, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			g.MemoryBytes = m.Total
		}
		if major, minor, ret := dev.GetCudaComputeCapability(); ret == nvml.SUCCESS {
			g.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
		}
		info.GPUs = append(info.GPUs, g)
	}
	sort.SliceStable(info.GPUs, func(a, b int) bool { return info.GPUs[a].Index < info.GPUs[b].Index })
	if len(errs) > 0 && len(info.GPUs) == 0 && n > 0 {
		return nil, errors.Join(errs...)
	}
	for _, e := range errs {
		info.Warnings = append(info.Warnings, e.Error())
	}
	return info, nil
}

func nvmlError(lib nvml.Interface, ret nvml.Return) string {
	return fmt.Sprintf("%s (%d)", lib.ErrorString(ret), int32(ret))
}

// nvmlBusID turns NVML's PCI info into the sysfs form "0000:3b:00.0".
func nvmlBusID(p nvml.PciInfo) string {
	b := make([]byte, 0, len(p.BusId))
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	if s := normalizePCI(string(b)); looksPCI(s) {
		return s
	}
	return fmt.Sprintf("%04x:%02x:%02x.0", p.Domain, p.Bus, p.Device)
}
