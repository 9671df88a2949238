// Package tools_test runs the tools as real processes: the CLI pipelines in
// testdata/script (testscript), and the man-page freshness check.
package tools_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/rogpeppe/go-internal/testscript"
	"github.com/stretchr/testify/require"
)

var binDir string

// TestMain finds the built tools in GPUBRIDGE_BIN (make test sets it), or
// builds them into a temporary folder.
func TestMain(m *testing.M) {
	os.Exit(func() int {
		binDir = os.Getenv("GPUBRIDGE_BIN")
		if binDir == "" {
			dir, err := os.MkdirTemp("", "gpubridge-bin")
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 2
			}
			defer os.RemoveAll(dir)
			cmd := exec.Command("go", "build", "-o", dir+"/", "./gbprobe", "./gbdiscover", "./gbbridge", "./gbtrace", "./gbcompress")
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				fmt.Fprintln(os.Stderr, "build tools:", err)
				return 2
			}
			binDir = dir
		}
		return m.Run()
	}())
}

func tools(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(".")
	require.NoError(t, err)
	var out []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "gb") {
			if _, err := os.Stat(filepath.Join(binDir, e.Name())); err == nil {
				out = append(out, e.Name())
			}
		}
	}
	require.NotEmpty(t, out, "no tools built in %s", binDir)
	return out
}

// TestManPagesFresh fails when a checked-in man page differs from what the
// tool's CLI model generates now (run `make man`).
func TestManPagesFresh(t *testing.T) {
	for _, tool := range tools(t) {
		t.Run(tool, func(t *testing.T) {
			var out bytes.Buffer
			cmd := exec.Command(filepath.Join(binDir, tool), "--man")
			cmd.Stdout = &out
			require.NoError(t, cmd.Run())
			want, err := os.ReadFile(filepath.Join("..", "man", tool+".1"))
			require.NoError(t, err, "man/%s.1 is missing: run make man", tool)
			require.Equal(t, string(want), out.String(), "man/%s.1 is stale: run make man", tool)
		})
	}
}

func TestScripts(t *testing.T) {
	testscript.Run(t, testscript.Params{
		Dir: "testdata/script",
		Setup: func(env *testscript.Env) error {
			env.Setenv("PATH", binDir+string(os.PathListSeparator)+env.Getenv("PATH"))
			env.Setenv("PYTHON", os.Getenv("GPUBRIDGE_PYTHON"))
			env.Setenv(testenv.ScaleVar, os.Getenv(testenv.ScaleVar))
			return nil
		},
		Cmds: map[string]func(ts *testscript.TestScript, neg bool, args []string){
			"storeaddr": cmdStoreAddr,
			"agree":     cmdAgree,
			"par":       cmdPar,
		},
		Condition: func(cond string) (bool, error) {
			switch cond {
			case "torch":
				return os.Getenv("GPUBRIDGE_PYTHON") != "", nil
			case "root":
				return os.Geteuid() == 0, nil
			}
			return false, fmt.Errorf("unknown condition %q", cond)
		},
	})
}

// cmdStoreAddr waits for the JSON line `gbdiscover serve` (or a torch store
// script) writes into a file and sets $STORE to its address. Its deadline
// catches a hang: a torch store script imports torch first, which takes
// many seconds on a loaded machine.
//
//	storeaddr FILE
func cmdStoreAddr(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: storeaddr FILE")
	}
	wait := testenv.Scale(60 * time.Second)
	deadline := time.Now().Add(wait)
	for {
		b, _ := os.ReadFile(ts.MkAbs(args[0]))
		if i := bytes.IndexByte(b, '\n'); i > 0 {
			var line struct {
				Listen string `json:"listen"`
			}
			ts.Check(json.Unmarshal(b[:i], &line))
			ts.Setenv("STORE", line.Listen)
			return
		}
		if time.Now().After(deadline) {
			ts.Fatalf("%s: no listen line within %v", args[0], wait)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cmdAgree checks that every rank's gbdiscover stdout says the same: the
// same topology (digest and shared part), or the same failure. With
// "ok" or "fail" first it also checks which.
//
//	agree ok|fail FILE...
func cmdAgree(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) < 2 || (args[0] != "ok" && args[0] != "fail") {
		ts.Fatalf("usage: agree ok|fail FILE...")
	}
	var first string
	for _, f := range args[1:] {
		var doc map[string]any
		ts.Check(json.Unmarshal([]byte(ts.ReadFile(f)), &doc))
		switch {
		case args[0] == "ok" && doc["schema"] == "gpubridge.topology/v1":
			delete(doc, "self")
		case args[0] == "fail" && doc["schema"] == "gpubridge.discover-failure/v1":
		default:
			ts.Fatalf("%s: want %s, got schema %v", f, args[0], doc["schema"])
		}
		b, err := json.Marshal(doc)
		ts.Check(err)
		if first == "" {
			first = string(b)
		} else if string(b) != first {
			ts.Fatalf("%s disagrees with %s:\n%s\n%s", f, args[1], b, first)
		}
	}
}

// cmdPar runs bash command lines concurrently and waits for all of them (a
// scaled 90 s at most, a hang guard). A line that starts with "! " must fail, any other must succeed.
// Unlike testscript's own background commands it leaves other background
// processes (a store server) running.
//
//	par 'LINE' '! LINE'...
func cmdPar(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) == 0 {
		ts.Fatalf("usage: par 'LINE'...")
	}
	limit := testenv.Scale(90 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	type result struct {
		line string
		fail bool
		err  error
		out  string
	}
	results := make([]result, len(args))
	var wg sync.WaitGroup
	for i, a := range args {
		fail := strings.HasPrefix(a, "! ")
		line := strings.TrimPrefix(a, "! ")
		results[i] = result{line: line, fail: fail}
		cmd := exec.CommandContext(ctx, "bash", "-c", line)
		cmd.Dir = ts.Getenv("WORK")
		cmd.Env = scriptEnv(ts)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := cmd.CombinedOutput()
			results[i].err, results[i].out = err, string(out)
		}()
	}
	wg.Wait()
	for _, r := range results {
		ts.Logf("par: %s: %v", r.line, r.err)
		if r.out != "" {
			ts.Logf("%s", r.out)
		}
		switch {
		case ctx.Err() != nil:
			ts.Fatalf("par: %s: still running after %v", r.line, limit)
		case r.fail && r.err == nil:
			ts.Fatalf("par: %s: succeeded, want failure", r.line)
		case !r.fail && r.err != nil:
			ts.Fatalf("par: %s: %v", r.line, r.err)
		}
	}
}

// scriptEnv is the environment of the running script as KEY=VALUE lines.
func scriptEnv(ts *testscript.TestScript) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if v := ts.Getenv(k); v != "" || k == "PATH" {
			env = append(env, k+"="+v)
		}
	}
	for _, k := range []string{"STORE", "PYTHON", "WORK", "HOME", "TMPDIR", "GPUBRIDGE_SPLIT_TEST", "GPUBRIDGE_VENDOR", testenv.ScaleVar} {
		if v := ts.Getenv(k); v != "" {
			env = append(env, k+"="+v)
		}
	}
	return env
}
