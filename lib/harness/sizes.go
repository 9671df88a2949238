package harness

import (
	"fmt"
	"strconv"
	"strings"
)

// ParseSizes parses "8,1K,64M,1G" (powers of 1024) into bytes.
func ParseSizes(s string) ([]int64, error) {
	var out []int64
	for _, f := range strings.Split(s, ",") {
		v, err := ParseSize(f)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// ParseSize parses one size: a positive number of bytes with an optional
// K, M or G suffix (powers of 1024) and an optional B, at most 1 TiB.
func ParseSize(s string) (int64, error) {
	f := strings.TrimSuffix(strings.ToUpper(strings.TrimSpace(s)), "B")
	mult := int64(1)
	if n := len(f); n > 0 {
		switch f[n-1] {
		case 'K':
			mult, f = 1<<10, f[:n-1]
		case 'M':
			mult, f = 1<<20, f[:n-1]
		case 'G':
			mult, f = 1<<30, f[:n-1]
		}
	}
	v, err := strconv.ParseInt(f, 10, 64)
	if err != nil || v <= 0 || v > (1<<40)/mult {
		return 0, fmt.Errorf("size %q: want a positive number of bytes with an optional K, M or G suffix (at most 1 TiB)", strings.TrimSpace(s))
	}
	return v * mult, nil
}

// DefaultSizes are 8 B … 1 GiB in steps of 8.
func DefaultSizes() []int64 {
	var out []int64
	for s := int64(8); s <= 1<<30; s *= 8 {
		out = append(out, s)
	}
	return out
}
