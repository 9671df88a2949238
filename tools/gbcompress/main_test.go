package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"flag"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/tools/internal/scripttest"
	"github.com/rogpeppe/go-internal/testscript"
	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite testdata/golden from the current codecs")

// TestMain lets the test binary act as gbcompress inside the scripts.
func TestMain(m *testing.M) {
	testscript.Main(m, map[string]func(){"gbcompress": main})
}

// TestScripts runs testdata/script/*.txtar; $GOLDEN is testdata/golden.
func TestScripts(t *testing.T) {
	golden, err := filepath.Abs(filepath.Join("testdata", "golden"))
	require.NoError(t, err)
	testscript.Run(t, testscript.Params{
		Dir: filepath.Join("testdata", "script"),
		Setup: func(env *testscript.Env) error {
			env.Setenv("GOLDEN", golden)
			return nil
		},
		Cmds: map[string]func(ts *testscript.TestScript, neg bool, args []string){"exits": scripttest.Exits},
	})
}

// goldenValues are the raw input of the golden files: 3000 float32
// values, gradient-like with every kind of special value mixed in.
func goldenValues() []byte {
	r := rand.New(rand.NewPCG(2026, 13))
	special := []uint32{0, 0x80000000, 1, 0x807fffff, 0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00001, 0x3f800000}
	b := make([]byte, 4*3000)
	for i := range 3000 {
		w := math.Float32bits(float32(r.NormFloat64() * math.Ldexp(1, -(i/256)-3)))
		if i%97 == 0 {
			w = special[(i/97)%len(special)]
		}
		binary.LittleEndian.PutUint32(b[4*i:], w)
	}
	return b
}

// run runs gbcompress in-process.
func run(t *testing.T, stdin []byte, args ...string) []byte {
	t.Helper()
	var out, errOut bytes.Buffer
	code := cli.Run(context.Background(), tool, &grammar{}, args, bytes.NewReader(stdin), &out, &errOut)
	require.Equal(t, 0, code, "gbcompress %v: %s", args, errOut.String())
	return out.Bytes()
}

// TestGolden pins the stream format and the codecs' bytes: encoding the
// golden values gives the checked-in streams, decoding them the
// checked-in values (go test -run TestGolden -update rewrites them, for a
// deliberate change of format).
func TestGolden(t *testing.T) {
	values := goldenValues()
	files := map[string][]byte{"values.f32": values}
	for _, c := range []string{"fp8", "bf16", "zstd"} {
		s := run(t, values, "encode", "--codec", c, "--chunk", "1024")
		files["values."+c+".gbcz"] = s
		files["values."+c+".decoded.f32"] = run(t, s, "decode")
	}
	fp8 := files["values.fp8.gbcz"]
	files["truncated.gbcz"] = fp8[:len(fp8)-10]
	bad := append([]byte(nil), fp8...)
	bad[16+12+40] ^= 0x10 // a code in the first record
	files["badcrc.gbcz"] = bad
	for name, want := range files {
		path := filepath.Join("testdata", "golden", name)
		if *update {
			require.NoError(t, os.WriteFile(path, want, 0o644))
			continue
		}
		got, err := os.ReadFile(path)
		require.NoError(t, err, "run go test -run TestGolden -update")
		require.Equal(t, got, want, "%s differs from what gbcompress writes now", name)
	}
	require.Equal(t, values, files["values.zstd.decoded.f32"], "zstd is lossless")
}
