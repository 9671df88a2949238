package main

import (
	"fmt"
	"io"
	"os"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/codec/stream"
	"github.com/gpubridge/gpubridge/lib/npy"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

type decodeCmd struct {
	DType  string `name:"dtype" enum:"f32,bf16,f16," default:"" help:"The output dtype: the stream's own when not given; fp8 streams decode to f32, bf16 or f16, bf16 streams to f32 or bf16."`
	Format string `name:"format" enum:"auto,raw,npy" default:"auto" help:"The output: raw values, a .npy file (with the stream's shape, or one dimension), or auto (.npy when the stream has a shape)."`
	Force  bool   `name:"force" short:"f" help:"Write binary data to a terminal."`
	Input  string `arg:"" optional:"" default:"-" help:"The gbcompress stream; - or none: stdin."`
}

// npyDescr is the .npy descr of an output dtype (bfloat16: numpy's 2-byte
// void, as ml_dtypes saves it).
var npyDescr = map[reduce.DType]string{reduce.Float32: "<f4", reduce.Float16: "<f2", reduce.BFloat16: "<V2"}

func (c *decodeCmd) Run(env *cli.Env) error {
	if err := refuseTerminal(env, c.Force); err != nil {
		return err
	}
	var src io.Reader = env.Stdin
	if c.Input != "-" {
		f, err := os.Open(c.Input)
		if err != nil {
			return cli.CannotRun(err)
		}
		defer f.Close()
		src = f
	}
	r, err := stream.NewReader(src, stream.ReaderOptions{OutDType: dtypes[c.DType]})
	if err != nil {
		return cli.CannotRun(fmt.Errorf("%s: %w", c.Input, err))
	}
	h := r.Header()
	asNpy := c.Format == "npy" || c.Format == "auto" && h.Shape != nil
	if asNpy {
		shape, fortran := h.Shape, h.Fortran
		if shape == nil {
			// No shape in the stream: the values must be read to count them.
			return c.decodeFlatNpy(env, r)
		}
		if err := npy.WriteHeader(env.Stdout, npy.Header{Descr: npyDescr[r.OutDType()], FortranOrder: fortran, Shape: shape}); err != nil {
			return cli.CannotRun(err)
		}
	}
	if _, err := io.Copy(env.Stdout, r); err != nil {
		return cli.CannotRun(fmt.Errorf("decode %s: %w", c.Input, err))
	}
	return nil
}

// decodeFlatNpy writes a stream without a shape as a one-dimensional .npy
// file: it decodes into memory first, since the header holds the length.
func (c *decodeCmd) decodeFlatNpy(env *cli.Env, r *stream.Reader) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return cli.CannotRun(fmt.Errorf("decode %s: %w", c.Input, err))
	}
	n := int64(len(data) / r.OutDType().Size())
	if err := npy.WriteHeader(env.Stdout, npy.Header{Descr: npyDescr[r.OutDType()], Shape: []int64{n}}); err != nil {
		return cli.CannotRun(err)
	}
	if _, err := env.Stdout.Write(data); err != nil {
		return cli.CannotRun(err)
	}
	return nil
}
