package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

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
			"exits": cmdExits,
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

// cmdExits runs a program and checks its exit status; stdout and stderr are
// kept for the stdout/stderr commands that follow.
//
//	exits CODE PROG ARGS...
func cmdExits(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) < 2 {
		ts.Fatalf("usage: exits CODE PROG ARGS...")
	}
	want, err := strconv.Atoi(args[0])
	ts.Check(err)
	err = ts.Exec(args[1], args[2:]...)
	got := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		got = ee.ExitCode()
	case err != nil:
		ts.Fatalf("%s: %v", args[1], err)
	}
	if got != want {
		ts.Fatalf("%s exited %d, want %d", args[1], got, want)
	}
}
