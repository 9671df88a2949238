package npy

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReadNumpyFiles reads headers numpy 2.4 wrote (testdata/*.npy) and
// checks that the data that follows is what the header says.
func TestReadNumpyFiles(t *testing.T) {
	for _, tc := range []struct {
		file  string
		want  Header
		bytes int64
	}{
		{"f4_3x4.npy", Header{Major: 1, Descr: "<f4", Shape: []int64{3, 4}}, 48},
		{"f2_scalar.npy", Header{Major: 1, Descr: "<f2", Shape: []int64{}}, 2},
		{"u1_empty.npy", Header{Major: 1, Descr: "|u1", Shape: []int64{0}}, 0},
		{"f8_fortran.npy", Header{Major: 1, Descr: "<f8", FortranOrder: true, Shape: []int64{2, 3}}, 48},
		{"v2_1d.npy", Header{Major: 1, Descr: "|V2", Shape: []int64{4}}, 8},
		{"version2.npy", Header{Major: 2, Descr: "<i4", Shape: []int64{5}}, 20},
		{"big_endian.npy", Header{Major: 1, Descr: ">f4", Shape: []int64{3}}, 12},
	} {
		t.Run(tc.file, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join("testdata", tc.file))
			require.NoError(t, err)
			r := bytes.NewReader(b)
			h, err := ReadHeader(r, Limits{})
			require.NoError(t, err)
			assert.Equal(t, tc.want, h)
			assert.Equal(t, tc.bytes, h.DataBytes())
			assert.Equal(t, int(tc.bytes), r.Len(), "the reader is at the data")
			assert.Zero(t, (len(b)-r.Len())%64, "numpy aligns the data to 64 bytes")
		})
	}
}

// TestWriteHeader: what WriteHeader writes, numpy's own layout (the same
// bytes as numpy's file) and ReadHeader reads back.
func TestWriteHeader(t *testing.T) {
	want, err := os.ReadFile(filepath.Join("testdata", "f4_3x4.npy"))
	require.NoError(t, err)
	var b bytes.Buffer
	require.NoError(t, WriteHeader(&b, Header{Descr: "<f4", Shape: []int64{3, 4}}))
	assert.Equal(t, want[:len(want)-48], b.Bytes())
	for _, shape := range [][]int64{{}, {7}, {1, 2, 3}} {
		b.Reset()
		require.NoError(t, WriteHeader(&b, Header{Descr: "<f2", Shape: shape}))
		h, err := ReadHeader(&b, Limits{})
		require.NoError(t, err)
		assert.Equal(t, shape, h.Shape)
		assert.Zero(t, b.Len())
	}
}

func header(major byte, dict string) []byte {
	b := append([]byte(Magic), major, 0)
	if major == 1 {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(dict)))
	} else {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(dict)))
	}
	return append(b, dict...)
}

func TestReadHeaderRefuses(t *testing.T) {
	ok := "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }"
	for _, tc := range []struct {
		name string
		in   []byte
		kind error
		msg  string
	}{
		{"empty", nil, ErrFormat, "input ends in the magic and version"},
		{"magic", []byte("\x93NUMPX\x01\x00\x00\x00"), ErrFormat, "does not begin with the .npy magic \\x93NUMPY"},
		{"version", header(4, ok), ErrFormat, "format version 4.0 (this reader knows 1.0, 2.0 and 3.0)"},
		{"short", header(1, ok)[:30], ErrFormat, "input ends in the header"},
		{"long header", append(header(2, "")[:8], 0xff, 0xff, 0xff, 0x7f), ErrLimit, "header of 2147483647 bytes (at most 65536)"},
		{"not a dict", header(1, "[1, 2]"), ErrFormat, `header is not a dict: "[1, 2]"`},
		{"structured", header(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }"), ErrFormat, "structured dtypes (descr a list) are not supported"},
		{"unknown key", header(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1}"), ErrFormat, `unknown key "x" (a .npy header has descr, fortran_order and shape)`},
		{"missing key", header(1, "{'descr': '<f4', 'shape': (3,)}"), ErrFormat, `no "fortran_order" in the header`},
		{"twice", header(1, "{'descr': '<f4', 'descr': '<f4'}"), ErrFormat, `key "descr" twice`},
		{"bad descr", header(1, "{'descr': 'float32', 'fortran_order': False, 'shape': (3,)}"), ErrFormat, `descr "float32" is not a simple dtype such as '<f4'`},
		{"bad size", header(1, "{'descr': '<f0', 'fortran_order': False, 'shape': (3,)}"), ErrFormat, `descr "<f0" has no valid item size`},
		{"negative dim", header(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-3,)}"), ErrFormat, `shape has a bad dimension at "-3,)}"`},
		{"overflow", header(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (999999999999999999, 999999999999999999)}"), ErrLimit, "shape [999999999999999999 999999999999999999] overflows"},
		{"too big", header(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,)}"), ErrLimit, "shape [1099511627776] of <f4 is 4398046511104 bytes (at most 1099511627776)"},
		{"too many dims", header(1, "{'descr': '<f4', 'fortran_order': False, 'shape': ("+strings.Repeat("1,", 65)+")}"), ErrLimit, "shape of more than 64 dimensions"},
		{"order", header(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (3,)}"), ErrFormat, "fortran_order is not True or False"},
		{"trailing", header(1, ok+" x"), ErrFormat, `text after the dict: "x"`},
		{"not ascii", header(1, "{'descr': '<f4\xff', 'fortran_order': False, 'shape': (3,)}"), ErrFormat, "header is not ASCII (byte 14)"},
		{"escape", header(1, "{'descr': '<f\\4', 'fortran_order': False, 'shape': (3,)}"), ErrFormat, `escapes in string "<f\\4"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadHeader(bytes.NewReader(tc.in), Limits{})
			require.Error(t, err)
			assert.ErrorIs(t, err, tc.kind)
			assert.Equal(t, ".npy: "+tc.msg, err.Error())
		})
	}
}

// FuzzReadHeader: no panic, and what is accepted writes back to a header
// that reads the same.
func FuzzReadHeader(f *testing.F) {
	for _, name := range []string{"f4_3x4.npy", "version2.npy", "f2_scalar.npy"} {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := ReadHeader(bytes.NewReader(data), Limits{MaxHeader: 4096, MaxBytes: 1 << 30})
		if err != nil {
			return
		}
		var b bytes.Buffer
		if err := WriteHeader(&b, h); err != nil {
			t.Fatal(err)
		}
		h2, err := ReadHeader(&b, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		h.Major, h.Minor, h2.Major, h2.Minor = 0, 0, 0, 0
		if h.Descr != h2.Descr || h.FortranOrder != h2.FortranOrder || len(h.Shape) != len(h2.Shape) {
			t.Fatalf("%+v read back as %+v", h, h2)
		}
	})
}
