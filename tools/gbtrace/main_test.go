package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/rogpeppe/go-internal/testscript"
)

// TestMain lets the test binary act as gbtrace inside the scripts.
func TestMain(m *testing.M) {
	testscript.Main(m, map[string]func(){"gbtrace": main})
}

// TestScripts runs testdata/script/*.txtar: gbtrace's pipelines on lib/trace's
// testdata ($TESTDATA: a real traced job, the dumps of a hang, torch
// Flight Recorder dumps, and the golden outputs the library's tests check).
func TestScripts(t *testing.T) {
	data, err := filepath.Abs(filepath.Join("..", "..", "lib", "trace", "testdata"))
	if err != nil {
		t.Fatal(err)
	}
	testscript.Run(t, testscript.Params{
		Dir: filepath.Join("testdata", "script"),
		Setup: func(env *testscript.Env) error {
			env.Setenv("TESTDATA", data)
			env.Setenv("GPUBRIDGE_LOG_LEVEL", os.Getenv("GPUBRIDGE_LOG_LEVEL"))
			return nil
		},
	})
}
