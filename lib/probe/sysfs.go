package probe

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// sysfs reads files under a root directory: "/" on a real node, a fake tree
// in tests. Reads of single attributes are small and never block on sysfs.
type sysfs struct{ root string }

func (s sysfs) path(rel string) string { return filepath.Join(s.root, rel) }

// read returns the trimmed content of a file, "" if it cannot be read (sysfs
// attributes that do not apply to a device fail with EINVAL or ENOENT).
func read(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// readUint parses a decimal or 0x-prefixed attribute; ok is false when the
// file is missing or not a number.
func readUint(path string) (uint64, bool) {
	s := read(path)
	if s == "" {
		return 0, false
	}
	v, err := strconv.ParseUint(s, 0, 64)
	if err != nil {
		return 0, false
	}
	return v, true
}

// list returns the names in dir, sorted; a missing dir is empty, not an
// error. Other errors (permission) are returned with the path.
func list(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", dir, err)
	}
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = e.Name()
	}
	sort.Strings(names)
	return names, nil
}

// linkBase returns the last element of a symlink's target ("" if path is
// not a symlink): the driver name of device/driver, the PCI address of
// card0/device.
func linkBase(path string) string {
	t, err := os.Readlink(path)
	if err != nil {
		return ""
	}
	return filepath.Base(t)
}

// pciAddress returns the PCI address of a sysfs device directory: the
// PCI_SLOT_NAME of its uevent, else the name its symlink points at.
func pciAddress(devDir string) string {
	if f, err := os.Open(filepath.Join(devDir, "uevent")); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "PCI_SLOT_NAME="); ok {
				return normalizePCI(v)
			}
		}
	}
	if t, err := filepath.EvalSymlinks(devDir); err == nil {
		if a := normalizePCI(filepath.Base(t)); looksPCI(a) {
			return a
		}
	}
	return ""
}

// normalizePCI lower-cases a PCI address and shortens NVML's 8-digit domain
// ("00000000:3B:00.0") to the 4 digits sysfs uses.
func normalizePCI(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	if dom, rest, ok := strings.Cut(s, ":"); ok && len(dom) == 8 && strings.HasPrefix(dom, "0000") {
		s = dom[4:] + ":" + rest
	}
	return s
}

// looksPCI reports whether s has the form dddd:bb:dd.f.
func looksPCI(s string) bool {
	var d, b, dev, f uint
	n, err := fmt.Sscanf(s, "%4x:%2x:%2x.%1x", &d, &b, &dev, &f)
	return err == nil && n == 4 && len(s) == 12
}

// keyValues parses a KFD-style "key value" per line file.
func keyValues(path string) (map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	kv := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), " ")
		if ok {
			kv[k] = strings.TrimSpace(v)
		}
	}
	return kv, nil
}

// afterColon strips a sysfs numeric prefix: "4: ACTIVE" -> "ACTIVE".
func afterColon(s string) string {
	if _, v, ok := strings.Cut(s, ":"); ok {
		return strings.TrimSpace(v)
	}
	return strings.TrimSpace(s)
}
