package ibverbs

import "slices"

// DeviceInfo is one device as Scan found it: its attributes and ports, or
// why it could not be opened or queried.
type DeviceInfo struct {
	Name  string
	Attr  DeviceAttr
	Ports []PortInfo
	Err   error
}

// PortInfo is one port of a device and its used GID entries.
type PortInfo struct {
	Num  int
	Attr PortAttr
	GIDs []GIDEntry
}

// Scan lists every device libibverbs sees, by name, with its ports and
// GIDs; a device that cannot be opened or queried carries the error.
func Scan() ([]DeviceInfo, error) {
	names, err := Devices()
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	out := make([]DeviceInfo, 0, len(names))
	for _, n := range names {
		out = append(out, scanDevice(n))
	}
	return out, nil
}

func scanDevice(name string) DeviceInfo {
	d := DeviceInfo{Name: name}
	c, err := Open(name)
	if err != nil {
		d.Err = err
		return d
	}
	defer c.Close()
	if d.Attr, d.Err = c.QueryDevice(); d.Err != nil {
		return d
	}
	for p := 1; p <= d.Attr.Ports; p++ {
		pi := PortInfo{Num: p}
		if pi.Attr, d.Err = c.QueryPort(p); d.Err != nil {
			return d
		}
		if pi.GIDs, d.Err = c.GIDs(p); d.Err != nil {
			return d
		}
		d.Ports = append(d.Ports, pi)
	}
	return d
}
