package reduce

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDTypeNamesAndSizes(t *testing.T) {
	for _, tc := range []struct {
		dt   DType
		name string
		size int
	}{
		{Float16, "float16", 2}, {BFloat16, "bfloat16", 2}, {Float32, "float32", 4}, {Float64, "float64", 8},
		{Int8, "int8", 1}, {Uint8, "uint8", 1}, {Int32, "int32", 4}, {Int64, "int64", 8},
	} {
		assert.Equal(t, tc.name, tc.dt.String())
		assert.Equal(t, tc.size, tc.dt.Size())
		got, err := ParseDType(tc.name)
		require.NoError(t, err)
		assert.Equal(t, tc.dt, got)
	}
	assert.Equal(t, []DType{Float16, BFloat16, Float32, Float64, Int8, Uint8, Int32, Int64}, AllDTypes())
	assert.Equal(t, "DType(0)", DType(0).String())
	assert.Equal(t, 0, DType(9).Size())
}

func TestParseDTypeAliases(t *testing.T) {
	for s, want := range map[string]DType{
		"half": Float16, "fp16": Float16, "torch.float16": Float16, " Float16 ": Float16, "f16": Float16,
		"bf16": BFloat16, "torch.bfloat16": BFloat16,
		"float": Float32, "fp32": Float32, "torch.float32": Float32, "FLOAT": Float32,
		"double": Float64, "fp64": Float64, "torch.float64": Float64,
		"int": Int32, "torch.int32": Int32, "long": Int64, "torch.int64": Int64,
		"torch.int8": Int8, "torch.uint8": Uint8, "u8": Uint8,
	} {
		got, err := ParseDType(s)
		require.NoError(t, err, s)
		assert.Equal(t, want, got, s)
	}
	for _, s := range []string{"", "int16", "short", "complex64", "float8", "torch."} {
		_, err := ParseDType(s)
		require.Error(t, err, s)
		assert.Contains(t, err.Error(), "unknown dtype")
	}
}

func TestOps(t *testing.T) {
	assert.Equal(t, []Op{Sum, Prod, Max, Min, Avg}, AllOps())
	for _, tc := range []struct {
		op   Op
		name string
	}{{Sum, "sum"}, {Prod, "prod"}, {Max, "max"}, {Min, "min"}, {Avg, "avg"}} {
		assert.Equal(t, tc.name, tc.op.String())
		got, err := ParseOp(tc.name)
		require.NoError(t, err)
		assert.Equal(t, tc.op, got)
	}
	for s, want := range map[string]Op{"SUM": Sum, "ReduceOp.PRODUCT": Prod, "product": Prod, "mean": Avg, " max ": Max, "ReduceOp.AVG": Avg} {
		got, err := ParseOp(s)
		require.NoError(t, err, s)
		assert.Equal(t, want, got, s)
	}
	_, err := ParseOp("band")
	require.Error(t, err)
	assert.Equal(t, "Op(0)", Op(0).String())
}

func TestSupported(t *testing.T) {
	for _, dt := range AllDTypes() {
		for _, op := range AllOps() {
			err := Supported(op, dt)
			if op == Avg && !dt.IsFloat() {
				require.Error(t, err, "%s %s", op, dt)
				assert.Contains(t, err.Error(), "avg is defined for floating dtypes only; use sum")
				assert.Contains(t, err.Error(), dt.String())
				continue
			}
			assert.NoError(t, err, "%s %s", op, dt)
		}
	}
	assert.ErrorContains(t, Supported(0, Float32), "invalid op")
	assert.ErrorContains(t, Supported(Sum, 0), "invalid dtype")
	assert.ErrorContains(t, Supported(Avg+1, Float32), "invalid op")
	assert.ErrorContains(t, Supported(Sum, Int64+1), "invalid dtype")
}
