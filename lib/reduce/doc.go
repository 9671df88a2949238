// Package reduce holds the elementwise reduction kernels of gbbridge: the
// arithmetic that combines the host buffers of two island leaders during an
// all-reduce. Its results are bit-exact and specified here, so every member
// of a job, on any machine, computes the same bytes, and Reference gives the
// bytes a collective must produce.
//
// # Buffers
//
// A buffer is the raw bytes of its elements, each little-endian (the layout
// of a torch tensor's storage on x86-64 and arm64). Combine(op, dt, dst, a, b)
// sets dst[i] = a[i] op b[i] for every element i; dst, a and b must have the
// same length, a multiple of dt.Size(), or Combine returns an error and
// touches nothing. dst may be the very same slice as a or as b (the usual
// in-place accumulation); any other overlap of dst with an input is refused
// with an error. Buffers need no particular alignment; aligned ones (the
// usual case: Go and torch allocate aligned memory) are faster.
//
// CombineParallel splits the work over goroutines at 64-byte boundaries;
// since every element is computed on its own, its bytes are identical to
// Combine's, whatever the number of workers. Below ParallelThreshold (256
// KiB) it runs inline.
//
// # Dtypes and ops
//
// The dtypes are float16 (IEEE binary16), bfloat16, float32, float64, int8,
// uint8, int32 and int64; ParseDType also takes the torch spellings (half,
// float, double, int, long, "torch.float16", ...) and short forms (fp16,
// bf16, fp32, ...). The ops are sum, prod, max, min and avg. Avg is
// defined for the floating dtypes only: an integer average would have to
// round, so Supported refuses it ("avg is defined for floating dtypes only;
// use sum"); sum and divide yourself, choosing the rounding.
//
// Avg is Sum followed by a post-step: Combine sums, and Finish(Avg, dt, buf,
// n) divides the final sum of n contributions by n. Finish does nothing for
// the other ops, or when n is 1.
//
// # Integers
//
// Sum and Prod wrap around modulo 2^bits (two's complement); they never fail
// or saturate. Max and Min compare signed for
// int8, int32 and int64 and unsigned for uint8. Every integer result is
// exact, so integer reductions do not depend on the order of the members.
//
// # float32 and float64
//
// Each Combine is a single IEEE 754 operation in the dtype's own precision,
// rounded to nearest, ties to even: a+b for Sum and Avg, a*b for Prod. There
// is no fused multiply-add, no reassociation, no wider intermediate and no
// flushing of denormals (subnormals are produced and consumed exactly).
// Infinities follow IEEE (Inf + 1 = Inf, Inf - Inf is a NaN, overflow
// gives ±Inf).
//
// Max and Min return one of their operands, compared as numbers, with -0
// below +0: max(-0, +0) = +0 and min(-0, +0) = -0 in either order. If
// either operand is a NaN the result is a NaN (NaNs propagate, like
// torch.maximum and torch.minimum, unlike C's fmax).
//
// Finish(Avg) divides each element x by n in the dtype's precision: x /
// float64(n) for float64, x / float32(n) for float32, rounded once (n is
// converted exactly up to 2^24 members for float32).
//
// # NaNs
//
// The hardware leaves the choice of NaN to the implementation, so this
// package fixes it: whenever an op's result is a NaN, it is
//
//  1. a, quieted, if a is a NaN; otherwise
//  2. b, quieted, if b is a NaN; otherwise (an invalid operation on
//     non-NaN operands: Inf - Inf, 0 * Inf)
//  3. the default NaN: positive, quiet, with an empty payload (float16
//     0x7e00, bfloat16 0x7fc0, float32 0x7fc00000, float64
//     0x7ff8000000000000).
//
// Quieting sets the top bit of the significand and keeps the sign and the
// rest of the payload, so a signalling NaN comes out quiet and a quiet NaN
// comes out unchanged. The rule applies to every op, Max and Min included,
// and to Finish (a NaN divided by n is that NaN, quieted). Because the
// rule picks a before b, Combine(op, dt, dst, a, b) and Combine(op, dt, dst,
// b, a) can differ in the payload of a NaN result, and only there.
//
// # float16 and bfloat16
//
// Each Combine widens both operands to float32 (exactly: every 16-bit value
// is a float32), does the operation once in float32, and rounds the result
// to the 16-bit type, to nearest, ties to even. So a reduction over n
// members rounds n-1 times, once per step, as NCCL and RCCL do when they
// reduce half-precision buffers step by step; its result depends on the
// order of the members, which is why Reference fixes one. Finish(Avg)
// widens, divides by float32(n) in float32 and rounds once.
//
// float32 carries at least twice the precision of either 16-bit type plus
// two bits, so rounding first to float32 and then to 16 bits gives the same
// result as rounding the exact sum, product or quotient directly (double
// rounding through such a format is innocuous): each step is the correctly
// rounded 16-bit operation, like a native half-precision add or multiply.
//
// Rounding to float16: magnitudes of 65520 and above (the tie between the
// largest finite value, 65504, and 65536 rounds to even, which is Inf)
// become ±Inf; results below 2^-14 become denormals or ±0, with the sign
// kept. bfloat16 has float32's exponent range: only finite values that round
// past 0x1.fep127 become ±Inf, and denormals are kept. Max and Min of 16-bit
// values are exact (they return an operand; the widening does not change
// the order), with the NaN and signed-zero rules above.
//
// The conversions are exported: F16ToF32 and BF16ToF32 widen exactly
// (keeping NaN payloads as they are), F32ToF16 and F32ToBF16 round to
// nearest even and turn a NaN into a quiet NaN with the same sign and the
// top bits of its payload.
//
// # Reference
//
// Reference(op, dt, inputs) reduces inputs[0], inputs[1], ... in the fixed
// order ((in[0] op in[1]) op in[2]) op ..., each step one Combine, and then
// applies Finish with n = len(inputs). A collective that combines the
// members' buffers in this order is bit-identical to it; integer
// reductions, Max and Min are identical in any order.
//
// # Speed
//
// On amd64 machines with AVX2 and F16C the kernels are assembly (generated
// by asmgen.go) and run at memory speed; elsewhere (and with the purego
// build tag) they are Go, tested bit for bit against the assembly. The
// assembly hands any 64-byte block whose result contains a NaN to the Go
// kernels, which own the NaN rule, so NaN-heavy buffers are slower but not
// different.
package reduce
