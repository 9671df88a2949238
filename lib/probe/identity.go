package probe

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// VisibleGPUs returns the GPUs of vendor a process on this node sees, in the
// order its runtime numbers them, after the runtime's visibility variables
// (read through lookupEnv, e.g. os.LookupEnv):
//
//   - nvidia: CUDA_VISIBLE_DEVICES, a comma list of indices or UUIDs
//     ("GPU-…", any unique prefix). As in CUDA, an entry that matches no
//     device ends the list. The base order is NVML's (PCI bus order),
//     which is CUDA's only under CUDA_DEVICE_ORDER=PCI_BUS_ID: set it.
//   - amd: ROCR_VISIBLE_DEVICES (indices or UUIDs) first, then
//     HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES when that is unset (as
//     HIP does), indexing into what ROCR left. The base order is KFD's.
//
// Unset variables leave every device visible; a set but empty one hides all.
// MIG instances ("MIG-…") are not supported and end the list.
func (r *Report) VisibleGPUs(vendor string, lookupEnv func(string) (string, bool)) []GPU {
	gpus := r.GPUsOf(vendor)
	switch vendor {
	case VendorNVIDIA:
		if v, ok := lookupEnv("CUDA_VISIBLE_DEVICES"); ok {
			gpus = selectVisible(gpus, v)
		}
	case VendorAMD:
		if v, ok := lookupEnv("ROCR_VISIBLE_DEVICES"); ok {
			gpus = selectVisible(gpus, v)
		}
		if v, ok := lookupEnv("HIP_VISIBLE_DEVICES"); ok {
			gpus = selectVisible(renumber(gpus), v)
		} else if v, ok := lookupEnv("CUDA_VISIBLE_DEVICES"); ok {
			gpus = selectVisible(renumber(gpus), v)
		}
	}
	return gpus
}

// renumber gives a list its positions as indices: a later visibility
// variable indexes into what an earlier one left.
func renumber(gpus []GPU) []GPU {
	out := make([]GPU, len(gpus))
	for i, g := range gpus {
		g.Index = i
		out[i] = g
	}
	return out
}

// selectVisible applies one visibility list to gpus (whose Index fields are
// the numbers the list refers to).
func selectVisible(gpus []GPU, list string) []GPU {
	out := []GPU{}
	if strings.TrimSpace(list) == "" {
		return out
	}
	for _, e := range strings.Split(list, ",") {
		e = strings.TrimSpace(e)
		g, ok := findVisible(gpus, e)
		if !ok {
			break
		}
		out = append(out, g)
	}
	return out
}

func findVisible(gpus []GPU, e string) (GPU, bool) {
	if i, err := strconv.Atoi(e); err == nil {
		for _, g := range gpus {
			if g.Index == i {
				return g, true
			}
		}
		return GPU{}, false
	}
	if !strings.HasPrefix(e, "GPU-") || len(e) <= len("GPU-") {
		return GPU{}, false
	}
	var found []GPU
	for _, g := range gpus {
		if strings.HasPrefix(strings.ToLower(g.UUID), strings.ToLower(e)) {
			found = append(found, g)
		}
	}
	if len(found) != 1 {
		return GPU{}, false
	}
	return found[0], true
}

// DeviceFor returns the GPU local rank localRank of vendor uses: entry
// localRank of VisibleGPUs, the device torch.cuda.set_device(local_rank)
// picks. getenv (os.Getenv, or a job's environment) cannot tell an empty
// variable from an unset one, so here an empty visibility variable counts as
// unset; VisibleGPUs with os.LookupEnv keeps CUDA's "empty hides all".
func (r *Report) DeviceFor(vendor string, localRank int, getenv func(string) string) (GPU, error) {
	return r.deviceFor(vendor, localRank, func(k string) (string, bool) {
		v := getenv(k)
		return v, v != ""
	})
}

func (r *Report) deviceFor(vendor string, localRank int, lookupEnv func(string) (string, bool)) (GPU, error) {
	if vendor != VendorNVIDIA && vendor != VendorAMD {
		return GPU{}, fmt.Errorf("GPU for local rank %d: vendor %q is not nvidia or amd", localRank, vendor)
	}
	vis := r.VisibleGPUs(vendor, lookupEnv)
	if localRank < 0 || localRank >= len(vis) {
		return GPU{}, fmt.Errorf("no %s GPU for local rank %d: %d visible (%d found on the node)%s",
			vendor, localRank, len(vis), len(r.GPUsOf(vendor)), visibilityHint(vendor, lookupEnv))
	}
	return vis[localRank], nil
}

// visibilityHint names the visibility variables that are set, for errors.
func visibilityHint(vendor string, lookupEnv func(string) (string, bool)) string {
	vars := []string{"CUDA_VISIBLE_DEVICES"}
	if vendor == VendorAMD {
		vars = []string{"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"}
	}
	var set []string
	for _, k := range vars {
		if v, ok := lookupEnv(k); ok {
			set = append(set, fmt.Sprintf("%s=%q", k, v))
		}
	}
	if len(set) == 0 {
		return ""
	}
	return " with " + strings.Join(set, " ")
}

// GPUIdentity returns the UUID and PCI address of the GPU local rank
// localRank will use, for the report's Vendor and the process environment
// (os.LookupEnv; see VisibleGPUs). Both are empty when there is no such GPU:
// vendor none or mixed, a simulated vendor without real GPUs of it, too few
// visible GPUs.
func (r *Report) GPUIdentity(localRank int) (uuid, pci string) {
	g, err := r.deviceFor(r.Vendor, localRank, os.LookupEnv)
	if err != nil {
		return "", ""
	}
	return g.UUID, g.PCIBusID
}
