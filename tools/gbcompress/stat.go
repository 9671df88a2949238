package main

import (
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/codec"
	"github.com/gpubridge/gpubridge/lib/errstat"
	"github.com/gpubridge/gpubridge/lib/reduce"
)

// StatSchema is the schema of stat's lines.
const StatSchema = "gpubridge.compress-stat/v1"

type statCmd struct {
	Codec    []string `name:"codec" default:"fp8,bf16,zstd" help:"The codecs to measure (comma-separated): fp8, bf16, zstd, raw. A codec that does not take the input's dtype is skipped with a warning."`
	DType    string   `name:"dtype" enum:"f32,bf16,f16," default:"" help:"The values' dtype: f32, bf16 or f16 (raw input: f32 when not given; a .npy file's own dtype must agree)."`
	Format   string   `name:"format" enum:"auto,raw,npy" default:"auto" help:"The input: raw values, a .npy file, or auto (.npy when it begins with the .npy magic)."`
	Chunk    int      `name:"chunk" default:"1048576" help:"Values per chunk: a multiple of 1024, at most 16777216."`
	Method   string   `name:"method" enum:"default,huff0,zstd,s2" default:"default" help:"zstd: how to pack the byte planes (see encode --help)."`
	MinSNR   float64  `name:"min-snr" placeholder:"DB" help:"Exit 1 if a lossy codec's SNR (dB) is below this on any input."`
	MaxBytes int64    `name:"max-bytes" default:"17179869184" help:"The largest input stat reads (it holds it, and a decoded copy, in memory)."`
	Files    []string `arg:"" optional:"" help:"The inputs; none or -: stdin."`
}

// statLine is one line of stat's output.
type statLine struct {
	Schema      string   `json:"schema"`
	Input       string   `json:"input"`
	Codec       string   `json:"codec"`
	Format      string   `json:"format"`
	CodecID     uint8    `json:"codec_id"`
	DType       string   `json:"dtype"`
	Shape       []int64  `json:"shape,omitempty"`
	Values      int64    `json:"values"`
	RawBytes    int64    `json:"raw_bytes"`
	PackedBytes int64    `json:"packed_bytes"`
	Ratio       float64  `json:"ratio"`
	Exact       bool     `json:"exact"`
	Differ      int64    `json:"differ"`
	MaxAbsErr   float64  `json:"max_abs_err"`
	MaxRelErr   float64  `json:"max_rel_err"`
	RMSE        float64  `json:"rmse"`
	SNRdB       *float64 `json:"snr_db"`
	Flushed     int64    `json:"flushed_to_zero"`
	Overflowed  int64    `json:"overflowed"`
	NonFiniteIn int64    `json:"nonfinite_in"`
	NaNKept     int64    `json:"nan_kept"`
	InfToNaN    int64    `json:"inf_to_nan"`
	ChunkValues int      `json:"chunk_values"`
	EncodeGBps  float64  `json:"encode_gbps"`
	DecodeGBps  float64  `json:"decode_gbps"`
	Threads     int      `json:"threads"`
}

func (c *statCmd) Run(env *cli.Env) error {
	var ids []codec.ID
	for _, name := range c.Codec {
		id, err := codec.Parse(name)
		if err != nil {
			return cli.CannotRun(err)
		}
		ids = append(ids, id)
	}
	if c.Chunk < codec.GroupElems || c.Chunk > 16<<20 || c.Chunk%codec.GroupElems != 0 {
		return cli.CannotRun(fmt.Errorf("--chunk %d: a multiple of %d, at most %d", c.Chunk, codec.GroupElems, 16<<20))
	}
	files := c.Files
	if len(files) == 0 {
		files = []string{"-"}
	}
	enc := json.NewEncoder(env.Stdout)
	failed := 0
	for _, name := range files {
		in, err := openInput(name, c.Format, c.DType, env.Stdin)
		if err != nil {
			return cli.CannotRun(err)
		}
		data, err := io.ReadAll(io.LimitReader(in.r, c.MaxBytes+1))
		in.close()
		switch {
		case err != nil:
			return cli.CannotRun(fmt.Errorf("read %s: %w", name, err))
		case int64(len(data)) > c.MaxBytes:
			return cli.CannotRun(fmt.Errorf("%s: more than --max-bytes %d", name, c.MaxBytes))
		case len(data)%in.dtype.Size() != 0:
			return cli.CannotRun(fmt.Errorf("%s: %d bytes are not whole %v values", name, len(data), in.dtype))
		}
		for _, id := range ids {
			if err := codec.Supports(id, in.dtype); err != nil {
				env.Log.Warn("codec skipped", "input", name, "codec", id.String(), "why", err.Error())
				continue
			}
			line, err := c.measure(id, in.dtype, data)
			if err != nil {
				return cli.CannotRun(fmt.Errorf("%s: %w", name, err))
			}
			line.Input = name
			if in.npy != nil {
				line.Shape = in.npy.Shape
			}
			if err := enc.Encode(line); err != nil {
				return cli.CannotRun(err)
			}
			if c.MinSNR != 0 && id.Lossy() && line.SNRdB != nil && *line.SNRdB < c.MinSNR {
				fmt.Fprintf(env.Stderr, "%s: %s: %s SNR %.1f dB is below --min-snr %g\n", env.Tool.Name, name, id, *line.SNRdB, c.MinSNR)
				failed++
			}
		}
	}
	if failed > 0 {
		return cli.Silent(cli.ExitFail)
	}
	return nil
}

// measure encodes and decodes data with id, chunk by chunk, and compares.
func (c *statCmd) measure(id codec.ID, dt reduce.DType, data []byte) (statLine, error) {
	size := dt.Size()
	chunkBytes := c.Chunk * size
	if id == codec.Zstd {
		chunkBytes = min(chunkBytes, codec.MaxLosslessChunk)
	}
	maxPacked, err := codec.MaxPackedLen(id, dt, chunkBytes/size)
	if err != nil {
		return statLine{}, err
	}
	// Pack everything first (timed), then unpack everything (timed), into
	// buffers whose pages are mapped already.
	n := (len(data) + chunkBytes - 1) / chunkBytes
	packed := make([][]byte, n)
	for i := range packed {
		packed[i] = touch(make([]byte, maxPacked))
	}
	back := touch(make([]byte, len(data)))
	var total int64
	opt := codec.LosslessOptions{Method: methods[c.Method]}
	t0 := time.Now()
	for i := range packed {
		off := i * chunkBytes
		k, err := codec.EncodeChunk(id, packed[i], dt, data[off:min(len(data), off+chunkBytes)], opt)
		if err != nil {
			return statLine{}, err
		}
		packed[i] = packed[i][:k]
		total += int64(k)
	}
	encode := time.Since(t0)
	t0 = time.Now()
	for i, p := range packed {
		off := i * chunkBytes
		if err := codec.DecodeChunk(id, back[off:min(len(data), off+chunkBytes)], dt, p); err != nil {
			return statLine{}, err
		}
	}
	decode := time.Since(t0)
	var s errstat.Stats
	if err := s.AddBuffers(dt, data, back); err != nil {
		return statLine{}, err
	}
	line := statLine{
		Schema: StatSchema, Codec: id.String(), Format: id.Versioned(), CodecID: uint8(id), DType: dt.String(),
		Values: int64(len(data) / size), RawBytes: int64(len(data)), PackedBytes: total,
		Exact: s.Differ == 0, Differ: s.Differ, MaxAbsErr: s.MaxAbs, MaxRelErr: s.MaxRel, RMSE: s.RMSE(),
		Flushed: s.Flushed, Overflowed: s.Overflowed, NonFiniteIn: s.NonFiniteIn, NaNKept: s.KeptNaNs, InfToNaN: s.InfToNaN,
		ChunkValues: chunkBytes / size, EncodeGBps: gbps(len(data), encode), DecodeGBps: gbps(len(data), decode), Threads: 1,
	}
	if total > 0 {
		line.Ratio = float64(len(data)) / float64(total)
	}
	if db, ok := s.SNR(); ok {
		line.SNRdB = &db
	}
	return line, nil
}

func gbps(n int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds() / 1e9
}

// touch writes every page of b, so that timing it measures no page faults.
func touch(b []byte) []byte {
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1
	}
	return b
}
