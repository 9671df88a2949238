package reduce

import (
	"fmt"
	"strings"
)

// DType is the element type of a buffer being reduced.
type DType uint8

// The element types. The numbering is stable: it may be written to the wire.
const (
	Float16 DType = iota + 1
	BFloat16
	Float32
	Float64
	Int8
	Uint8
	Int32
	Int64
)

var dtypeNames = [...]string{
	Float16:  "float16",
	BFloat16: "bfloat16",
	Float32:  "float32",
	Float64:  "float64",
	Int8:     "int8",
	Uint8:    "uint8",
	Int32:    "int32",
	Int64:    "int64",
}

var dtypeSizes = [...]int{
	Float16:  2,
	BFloat16: 2,
	Float32:  4,
	Float64:  8,
	Int8:     1,
	Uint8:    1,
	Int32:    4,
	Int64:    8,
}

// dtypeAliases maps every accepted spelling (lower case, without a "torch."
// prefix) to its DType.
var dtypeAliases = map[string]DType{
	"float16": Float16, "half": Float16, "fp16": Float16, "f16": Float16,
	"bfloat16": BFloat16, "bf16": BFloat16,
	"float32": Float32, "float": Float32, "fp32": Float32, "f32": Float32,
	"float64": Float64, "double": Float64, "fp64": Float64, "f64": Float64,
	"int8": Int8, "i8": Int8,
	"uint8": Uint8, "u8": Uint8, "byte": Uint8,
	"int32": Int32, "int": Int32, "i32": Int32,
	"int64": Int64, "long": Int64, "i64": Int64,
}

func (d DType) valid() bool { return d >= Float16 && d <= Int64 }

// String returns the canonical (torch) name: "float16", "bfloat16",
// "float32", "float64", "int8", "uint8", "int32" or "int64".
func (d DType) String() string {
	if !d.valid() {
		return fmt.Sprintf("DType(%d)", uint8(d))
	}
	return dtypeNames[d]
}

// Size returns the size of one element in bytes, or 0 for an invalid DType.
func (d DType) Size() int {
	if !d.valid() {
		return 0
	}
	return dtypeSizes[d]
}

// IsFloat reports whether d is a floating-point type.
func (d DType) IsFloat() bool { return d >= Float16 && d <= Float64 }

// ParseDType parses a dtype name. It accepts the canonical names, an optional
// "torch." prefix, the torch aliases (half, float, double, int, long) and the
// short forms fp16, bf16, fp32, fp64, f16, f32, f64, i8, u8, i32, i64; case
// and surrounding space are ignored.
func ParseDType(s string) (DType, error) {
	k := strings.ToLower(strings.TrimSpace(s))
	k = strings.TrimPrefix(k, "torch.")
	if d, ok := dtypeAliases[k]; ok {
		return d, nil
	}
	return 0, fmt.Errorf("reduce: unknown dtype %q (want one of %s)", s, strings.Join(dtypeNames[1:], ", "))
}

// AllDTypes returns every DType in numbering order.
func AllDTypes() []DType {
	return []DType{Float16, BFloat16, Float32, Float64, Int8, Uint8, Int32, Int64}
}

// Op is a reduction operation.
type Op uint8

// The operations. The numbering is stable: it may be written to the wire.
const (
	Sum Op = iota + 1
	Prod
	Max
	Min
	Avg
)

var opNames = [...]string{Sum: "sum", Prod: "prod", Max: "max", Min: "min", Avg: "avg"}

func (o Op) valid() bool { return o >= Sum && o <= Avg }

// String returns "sum", "prod", "max", "min" or "avg".
func (o Op) String() string {
	if !o.valid() {
		return fmt.Sprintf("Op(%d)", uint8(o))
	}
	return opNames[o]
}

// ParseOp parses an operation name: sum, prod, max, min or avg, ignoring case
// and surrounding space; the torch.distributed spellings ("ReduceOp.SUM",
// "product", "mean", "average") are accepted too.
func ParseOp(s string) (Op, error) {
	k := strings.ToLower(strings.TrimSpace(s))
	k = strings.TrimPrefix(k, "reduceop.")
	switch k {
	case "sum":
		return Sum, nil
	case "prod", "product":
		return Prod, nil
	case "max":
		return Max, nil
	case "min":
		return Min, nil
	case "avg", "mean", "average":
		return Avg, nil
	}
	return 0, fmt.Errorf("reduce: unknown op %q (want one of sum, prod, max, min, avg)", s)
}

// AllOps returns every Op in numbering order.
func AllOps() []Op { return []Op{Sum, Prod, Max, Min, Avg} }

// Supported reports whether op can reduce dt: nil, or an error saying why
// not. Every op is defined for every dtype except Avg, which is defined for
// the floating dtypes only (an integer average would have to round; sum and
// divide by the member count yourself).
func Supported(op Op, dt DType) error {
	if !op.valid() {
		return fmt.Errorf("reduce: invalid op %d", uint8(op))
	}
	if !dt.valid() {
		return fmt.Errorf("reduce: invalid dtype %d", uint8(dt))
	}
	if op == Avg && !dt.IsFloat() {
		return fmt.Errorf("reduce: avg of %s: avg is defined for floating dtypes only; use sum", dt)
	}
	return nil
}
