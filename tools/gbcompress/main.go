// Command gbcompress is gpubridge's codecs as a Unix filter: encode raw
// values or a .npy file with fp8 (MXFP8), bf16 or zstd, decode them back,
// and measure what a codec does to a buffer (ratio, errors, speed) before
// compression is turned on for a job.
package main

import (
	"fmt"
	"os"

	"github.com/gpubridge/gpubridge/lib/cli"
	"golang.org/x/sys/unix"
)

type grammar struct {
	Encode encodeCmd `cmd:"" help:"Pack raw values (stdin or FILE) or a .npy file with a codec into a gbcompress stream on stdout."`
	Decode decodeCmd `cmd:"" help:"Unpack a gbcompress stream (stdin or FILE) into raw values or a .npy file on stdout."`
	Stat   statCmd   `cmd:"" help:"Measure codecs on raw values or .npy files: ratio, max abs/rel error, RMSE, SNR, throughput; JSON lines on stdout."`
}

// refuseTerminal keeps binary output off a terminal unless --force (a
// character device that is not a tty, such as /dev/null, is fine).
func refuseTerminal(env *cli.Env, force bool) error {
	f, ok := env.Stdout.(*os.File)
	if force || !ok {
		return nil
	}
	if _, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS); err == nil {
		return cli.CannotRun(fmt.Errorf("refusing to write binary data to a terminal: redirect stdout, or pass --force"))
	}
	return nil
}

var tool = cli.Tool{
	Name:    "gbcompress",
	Summary: "gpubridge's codecs as a Unix filter: fp8 (MXFP8), bf16 and zstd; encode, decode, stat",
	Description: `gbcompress packs buffers of values the way the bridge compresses them, and measures what that does to them, so that a saved gradient dump can be checked before compression is turned on for a job. The formats are specified in docs/COMPRESSION.md; the codecs are lib/codec's, the same bytes the bridge and the plugin's torch quantizer produce.

Codecs: fp8 (fp8/v1: OCP MX v1.0 MXFP8, blocks of 32 E4M3 values sharing a power-of-two E8M0 scale, 33 bytes per 32 values: 3.88x smaller than float32; lossy), bf16 (bf16/v1: float32 rounded to nearest even bfloat16; 2x; bfloat16 input passes unchanged), zstd (zstd/v1: lossless; the values' bytes split into planes, exponents apart from mantissas, each plane Huffman-coded, zstd- or s2-compressed (--method), or stored), raw (the bytes as they are).

Input: raw little-endian values of --dtype (f32, bf16 or f16; f32 when not given), or a NumPy .npy file (format 1.0, 2.0 or 3.0; '<f4', '<f2', or numpy's 2-byte void dtype with --dtype bf16). --format auto (the default) reads a .npy file when the input begins with the .npy magic, raw values otherwise. fp8 takes f32, bf16 and f16; bf16 takes f32 and bf16; zstd and raw take all three.

gbcompress encode writes a gbcompress stream: a header naming the codec, the dtype and the chunk size (and the .npy shape, if the input had one), then one record per chunk of --chunk values with a CRC32C, and an end record with the number of values. gbcompress decode checks every field against its limits before it allocates or decodes, and fails on a damaged or truncated stream; it writes raw values, or a .npy file when the stream carries a shape (--format). --dtype on decode chooses the output dtype of an fp8 stream (f32, bf16 or f16: the decoded values are exact in float32 and rounded to nearest even otherwise) or a bf16 stream (f32 or bf16).

gbcompress stat reads each FILE (or stdin) whole, encodes and decodes it with each --codec in chunks of --chunk values on one goroutine, and prints one JSON line per file and codec. Throughput is that one goroutine's: raw bytes per second of wall time on this machine, as loaded as it is. --min-snr turns it into a verdict.

Binary output is refused on a terminal without --force.`,
	Output: `encode: the gbcompress stream (docs/COMPRESSION.md). decode: raw little-endian values, or a .npy file. Nothing else goes to stdout; errors go to stderr.

stat: one JSON object per line, per file and codec, schema "gpubridge.compress-stat/v1": schema; input (the file name, "-" for stdin); codec ("fp8", "bf16", "zstd", "raw"); format ("fp8/v1", ...); codec_id; dtype; shape (from a .npy header; absent for raw input); values; raw_bytes; packed_bytes; ratio (raw / packed); exact (every value's bits came back); differ (values whose bits changed); max_abs_err, max_rel_err, rmse (over finite values; rel over non-zero ones); snr_db (10 log10 of signal over error energy; null when there is no error); flushed_to_zero (non-zero values that came back zero); overflowed (finite values that came back infinite); nonfinite_in (NaN and infinite inputs); nan_kept; inf_to_nan (fp8 has no infinity); chunk_values; encode_gbps, decode_gbps (raw GB/s, one goroutine); threads (1). Fields may be added within v1.`,
	ExitCodes: []cli.ExitCode{
		{Code: cli.ExitOK, Meaning: "the command ran: encoded, decoded, or measured (and every lossy codec met --min-snr)"},
		{Code: cli.ExitFail, Meaning: "stat: a lossy codec's SNR is below --min-snr (the JSON lines are printed first, one line per codec on stderr)"},
		{Code: cli.ExitUsage, Meaning: "could not run: bad usage, a codec that does not take the dtype, an unreadable or truncated input, a .npy header or a gbcompress stream that is damaged or over a limit, binary output to a terminal, an I/O error"},
	},
	Examples: []cli.Example{
		{Command: "gbcompress encode --codec fp8 --dtype f32 < grads.f32 > grads.gbcz", Text: "Pack raw float32 values with MXFP8 (3.88x smaller)."},
		{Command: "gbcompress decode < grads.gbcz > back.f32", Text: "Unpack them: float32 values, each within 1/16 of the original (or of the block's scale)."},
		{Command: "gbcompress encode --codec zstd grads.npy | gbcompress decode | cmp - <(tail -c +129 grads.npy)", Text: "The lossless codec gives back every byte (here the data after a 128-byte .npy header)."},
		{Command: "gbcompress stat --codec fp8,bf16,zstd bucket0.npy | jq '{codec, ratio, snr_db, max_rel_err, encode_gbps}'", Text: "What each codec does to a saved gradient bucket."},
		{Command: "gbcompress stat --codec fp8 --min-snr 30 bucket*.npy >/dev/null || echo 'fp8 loses too much here'", Text: "A verdict for a script: exit 1 if fp8's SNR is below 30 dB on any dump."},
		{Command: "python -c 'import torch, numpy; numpy.save(\"g.npy\", torch.randn(1<<20).numpy())' && gbcompress stat g.npy", Text: "Try it on synthetic data."},
	},
	SeeAlso: []string{"gbbridge"},
}

func main() { cli.Main(tool, &grammar{}) }
