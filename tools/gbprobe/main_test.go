package main

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpubridge/gpubridge/tools/internal/scripttest"
	"github.com/rogpeppe/go-internal/testscript"
)

// TestMain lets the test binary act as gbprobe inside the scripts.
func TestMain(m *testing.M) {
	testscript.Main(m, map[string]func(){"gbprobe": main})
}

// TestScripts runs testdata/script/*.txtar. $TREES is the fake sysfs trees
// of lib/probe (see lib/probe/testdata/sysfs/make-trees.sh).
func TestScripts(t *testing.T) {
	trees, err := filepath.Abs(filepath.Join("..", "..", "lib", "probe", "testdata", "sysfs"))
	if err != nil {
		t.Fatal(err)
	}
	testscript.Run(t, testscript.Params{
		Dir: filepath.Join("testdata", "script"),
		Setup: func(env *testscript.Env) error {
			env.Setenv("TREES", trees)
			return nil
		},
		Cmds: map[string]func(ts *testscript.TestScript, neg bool, args []string){
			"exits": scripttest.Exits,
		},
		Condition: func(cond string) (bool, error) {
			switch cond {
			case "nvidiadriver":
				_, err := os.Stat("/dev/nvidiactl")
				return err == nil, nil
			}
			return false, errors.New("unknown condition " + cond)
		},
	})
}
