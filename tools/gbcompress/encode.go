package main

import (
	"fmt"
	"io"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/codec/stream"
)

type encodeCmd struct {
	Codec  string `name:"codec" required:"" enum:"fp8,bf16,zstd,raw" help:"The codec: fp8, bf16, zstd or raw."`
	DType  string `name:"dtype" enum:"f32,bf16,f16," default:"" help:"The values' dtype: f32, bf16 or f16 (raw input: f32 when not given; a .npy file's own dtype must agree)."`
	Format string `name:"format" enum:"auto,raw,npy" default:"auto" help:"The input: raw values, a .npy file, or auto (.npy when it begins with the .npy magic)."`
	Chunk  int    `name:"chunk" default:"1048576" help:"Values per record: a multiple of 1024 (fp8's group), at most 16777216; zstd chunks at most 64 MiB."`
	Method string `name:"method" enum:"default,huff0,zstd,s2" default:"default" help:"zstd: how to pack the byte planes: default (huff0, and zstd too on a plane huff0 shrinks below a quarter), huff0, zstd (a little smaller on gradients, about half as fast), s2 (faster, larger)."`
	Force  bool   `name:"force" short:"f" help:"Write binary data to a terminal."`
	Input  string `arg:"" optional:"" default:"-" help:"The input file; - or none: stdin."`
}

// methods are the values of --method.
var methods = map[string]codec.Method{"default": 0, "huff0": codec.Huff0Plane, "zstd": codec.ZstdPlane, "s2": codec.S2Plane}

func (c *encodeCmd) Run(env *cli.Env) error {
	if err := refuseTerminal(env, c.Force); err != nil {
		return err
	}
	id, err := codec.Parse(c.Codec)
	if err != nil {
		return cli.CannotRun(err)
	}
	in, err := openInput(c.Input, c.Format, c.DType, env.Stdin)
	if err != nil {
		return cli.CannotRun(err)
	}
	defer in.close()
	h := stream.Header{Codec: id, DType: in.dtype, ChunkValues: c.Chunk}
	if in.npy != nil {
		h.Shape, h.Fortran = in.npy.Shape, in.npy.FortranOrder
	}
	w, err := stream.NewWriter(env.Stdout, h, stream.Options{Lossless: codec.LosslessOptions{Method: methods[c.Method]}})
	if err != nil {
		return cli.CannotRun(err)
	}
	if _, err := io.Copy(w, in.r); err != nil {
		return cli.CannotRun(fmt.Errorf("encode %s: %w", in.name, err))
	}
	if err := w.Close(); err != nil {
		return cli.CannotRun(fmt.Errorf("encode %s: %w", in.name, err))
	}
	env.Log.Debug("encoded", "codec", id.Versioned(), "dtype", in.dtype, "values", w.Values())
	return nil
}
