package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/gpubridge/gpubridge/lib/npy"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// input is a buffer of values to encode or measure: its dtype, the .npy
// header it came with (nil for raw input), and a reader of its values
// that fails if a .npy file holds more or fewer bytes than its header says.
type input struct {
	name  string
	dtype reduce.DType
	npy   *npy.Header
	r     io.Reader
	close func() error
}

// dtypes are the values of --dtype.
var dtypes = map[string]reduce.DType{"f32": reduce.Float32, "bf16": reduce.BFloat16, "f16": reduce.Float16}

// openInput opens name ("-": stdin) as raw values of --dtype (f32 when
// not given) or as a .npy file: format npy, or auto and the file begins
// with the .npy magic. A .npy file's dtype comes from its header; --dtype,
// if given, must agree (and says bf16 for numpy's 2-byte void dtype).
func openInput(name, format, dtype string, stdin io.Reader) (*input, error) {
	in := &input{name: name, close: func() error { return nil }}
	var r io.Reader = stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return nil, err
		}
		r, in.close = f, f.Close
	}
	br := bufio.NewReaderSize(r, 1<<20)
	if format == "auto" {
		format = "raw"
		if head, _ := br.Peek(len(npy.Magic)); string(head) == npy.Magic {
			format = "npy"
		}
	}
	want, given := dtypes[dtype]
	if format == "raw" {
		in.dtype, in.r = reduce.Float32, br
		if given {
			in.dtype = want
		}
		return in, nil
	}
	h, err := npy.ReadHeader(br, npy.Limits{})
	if err != nil {
		in.close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	dt, err := npyDType(h.Descr, want, given)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	in.dtype, in.npy = dt, &h
	in.r = &exactReader{r: br, left: h.DataBytes(), name: name}
	return in, nil
}

// npyDType maps a .npy descr to a dtype gbcompress takes.
func npyDType(descr string, want reduce.DType, given bool) (reduce.DType, error) {
	var dt reduce.DType
	switch descr {
	case "<f4":
		dt = reduce.Float32
	case "<f2":
		dt = reduce.Float16
	case "<V2", "|V2":
		if !given || want != reduce.BFloat16 {
			return 0, fmt.Errorf("dtype %q (2 bytes without a type: numpy's way of saving bfloat16): pass --dtype bf16 if it holds bfloat16", descr)
		}
		return reduce.BFloat16, nil
	default:
		if len(descr) > 0 && descr[0] == '>' {
			return 0, fmt.Errorf("dtype %q is big-endian: gbcompress reads little-endian values only", descr)
		}
		return 0, fmt.Errorf("dtype %q: gbcompress takes float32 ('<f4'), float16 ('<f2') and bfloat16 (with --dtype bf16)", descr)
	}
	if given && want != dt {
		return 0, fmt.Errorf("--dtype %v, but the file holds %v (%q)", want, dt, descr)
	}
	return dt, nil
}

// exactReader reads exactly left bytes and then wants EOF.
type exactReader struct {
	r    io.Reader
	left int64
	name string
}

func (e *exactReader) Read(p []byte) (int, error) {
	if e.left == 0 {
		var b [1]byte
		if n, _ := io.ReadFull(e.r, b[:]); n > 0 {
			return 0, fmt.Errorf("%s: more data than the .npy header's shape holds", e.name)
		}
		return 0, io.EOF
	}
	n, err := e.r.Read(p[:min(int64(len(p)), e.left)])
	e.left -= int64(n)
	if errors.Is(err, io.EOF) && e.left > 0 {
		return n, fmt.Errorf("%s: the data ends %d bytes before the .npy header's shape", e.name, e.left)
	}
	if err == io.EOF {
		err = nil
	}
	return n, err
}
