package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A go test -json stream (trimmed from a real one): a passing package, a
// failing test with a log line, a skipped test and subtest, a test skipped
// here that passes in the other stream.
const raceStream = `{"Action":"start","Package":"github.com/gpubridge/gpubridge/lib/a"}
{"Action":"run","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestOK"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestOK","Output":"=== RUN   TestOK\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestOK","Output":"    a_test.go:5: chatter\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestOK","Output":"--- PASS: TestOK (0.00s)\n"}
{"Action":"pass","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestOK"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestNoAllocs","Output":"=== RUN   TestNoAllocs\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestNoAllocs","Output":"    a_test.go:9: the race detector allocates\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestNoAllocs","Output":"--- SKIP: TestNoAllocs (0.00s)\n"}
{"Action":"skip","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestNoAllocs"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Output":"PASS\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Output":"ok  \tgithub.com/gpubridge/gpubridge/lib/a\t0.012s\n"}
{"Action":"pass","Package":"github.com/gpubridge/gpubridge/lib/a"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestNet","Output":"=== RUN   TestNet\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestNet","Output":"    net_test.go:31: logged first\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestNet","Output":"    net_test.go:40: needs root: creates network\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestNet","Output":"        namespaces\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestNet","Output":"--- SKIP: TestNet (0.00s)\n"}
{"Action":"skip","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestNet"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad","Output":"=== RUN   TestBad\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad/sub","Output":"=== RUN   TestBad/sub\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad/sub","Output":"    bad_test.go:7: skipped sub\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad/sub","Output":"    --- SKIP: TestBad/sub (0.00s)\n"}
{"Action":"skip","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad/sub"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad","Output":"    bad_test.go:12: want 2, got 3\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad","Output":"--- FAIL: TestBad (0.00s)\n"}
{"Action":"fail","Package":"github.com/gpubridge/gpubridge/lib/b","Test":"TestBad"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Output":"FAIL\n"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/b","Output":"FAIL\tgithub.com/gpubridge/gpubridge/lib/b\t0.020s\n"}
{"Action":"fail","Package":"github.com/gpubridge/gpubridge/lib/b"}
`

const noraceStream = `{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestNoAllocs","Output":"=== RUN   TestNoAllocs\n"}
{"Action":"pass","Package":"github.com/gpubridge/gpubridge/lib/a","Test":"TestNoAllocs"}
{"Action":"output","Package":"github.com/gpubridge/gpubridge/lib/a","Output":"ok  \tgithub.com/gpubridge/gpubridge/lib/a\t0.002s\n"}
{"Action":"pass","Package":"github.com/gpubridge/gpubridge/lib/a"}
`

const junit = `<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="0" failures="0" skipped="2" tests="3">
<testcase classname="tests.test_feed" name="test_ok" time="0.1" />
<testcase classname="tests.test_feed" name="test_tools" time="0.0"><skipped type="pytest.skip" message="GPUBRIDGE_BIN not set">tests/test_feed.py:46: GPUBRIDGE_BIN not set</skipped></testcase>
<testcase classname="tests.test_slurm" name="test_prolog" time="0.0"><skipped type="pytest.skip" message="needs root to start slurmd">tests/test_slurm.py:9: needs root to start slurmd</skipped></testcase>
</testsuite></testsuites>`

func TestTeePrintsWhatPlainGoTestPrints(t *testing.T) {
	var raw, out bytes.Buffer
	failed, err := tee(strings.NewReader(raceStream+"# some go message\n"), &raw, &out)
	require.NoError(t, err)
	assert.True(t, failed)
	assert.Equal(t, raceStream+"# some go message\n", raw.String(), "the raw stream is kept whole")
	assert.Equal(t, "ok  \tgithub.com/gpubridge/gpubridge/lib/a\t0.012s\n"+
		"    bad_test.go:12: want 2, got 3\n"+
		"--- FAIL: TestBad (0.00s)\n"+
		"FAIL\n"+
		"FAIL\tgithub.com/gpubridge/gpubridge/lib/b\t0.020s\n"+
		"# some go message\n", out.String())

	out.Reset()
	failed, err = tee(strings.NewReader(noraceStream), &raw, &out)
	require.NoError(t, err)
	assert.False(t, failed)
	assert.Equal(t, "ok  \tgithub.com/gpubridge/gpubridge/lib/a\t0.002s\n", out.String())
}

func TestTeeBuildFailure(t *testing.T) {
	var raw, out bytes.Buffer
	failed, err := tee(strings.NewReader(`{"ImportPath":"github.com/gpubridge/gpubridge/lib/c","Action":"build-output","Output":"lib/c/c.go:3:1: syntax error\n"}
{"ImportPath":"github.com/gpubridge/gpubridge/lib/c","Action":"build-fail"}
`), &raw, &out)
	require.NoError(t, err)
	assert.True(t, failed)
	assert.Equal(t, "lib/c/c.go:3:1: syntax error\n", out.String())
}

func TestGoReason(t *testing.T) {
	tests := []struct {
		name  string
		lines []string
		want  string
	}{
		{"skip line", []string{"=== RUN   TestX\n", "    x_test.go:3: opt-in: set X=1\n", "--- SKIP: TestX (0.00s)\n"}, "opt-in: set X=1"},
		{"the last log line is the skip", []string{"    x_test.go:3: setting up\n", "    x_test.go:9: no ip here\n"}, "no ip here"},
		{"continuation lines", []string{"    x_test.go:3: first\n", "        second\n"}, "first second"},
		{"subtest indentation", []string{"        x_test.go:3: deep\n", "    --- SKIP: TestX/a (0.00s)\n"}, "deep"},
		{"no log line", []string{"=== RUN   TestX\n", "--- SKIP: TestX (0.00s)\n"}, "(no reason given)"},
		{"plain text", []string{"testscript skipped: [!root]\n"}, "testscript skipped: [!root]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, goReason(tc.lines))
		})
	}
}

func writeDir(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, body := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	return dir
}

func TestSkipsListsEverySource(t *testing.T) {
	dir := writeDir(t, map[string]string{
		"go-race.json":   raceStream,
		"go-norace.json": noraceStream,
		"pytest.xml":     junit,
		"make.skip":      "slurm-test\tneeds root: installs and starts Slurm\n",
		"notes.txt":      "ignored",
	})
	var out, errb bytes.Buffer
	code := run([]string{"skips", "-root", "no", dir}, nil, &out, &errb)
	require.Equal(t, 0, code, errb.String())
	assert.Equal(t, `skipped tests (6):
   go-race    lib/a TestNoAllocs: the race detector allocates [passed in go-norace]
   go-race    lib/b TestBad/sub: skipped sub
   go-race    lib/b TestNet: needs root: creates network namespaces
   make       slurm-test: needs root: installs and starts Slurm
   pytest     tests.test_feed::test_tools: GPUBRIDGE_BIN not set
   pytest     tests.test_slurm::test_prolog: needs root to start slurmd
`, out.String())
}

// As root, a skip of a test that needs root fails the run, whichever kind
// of test it is.
func TestSkipsOfRootTestsFailAsRoot(t *testing.T) {
	tests := []struct {
		name  string
		files map[string]string
		bad   []string
	}{
		{"go", map[string]string{"go-race.json": raceStream}, []string{"lib/b TestNet"}},
		{"pytest", map[string]string{"pytest.xml": junit}, []string{"tests.test_slurm::test_prolog"}},
		{"make", map[string]string{"make.skip": "slurm-test\tNeeds root: installs Slurm\n"}, []string{"slurm-test"}},
		{"no root test", map[string]string{"go-norace.json": noraceStream}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := writeDir(t, tc.files)
			var out, errb bytes.Buffer
			code := run([]string{"skips", "-root", "yes", dir}, nil, &out, &errb)
			if tc.bad == nil {
				assert.Equal(t, 0, code, out.String())
				assert.NotContains(t, out.String(), "FAIL")
				return
			}
			assert.Equal(t, 1, code, out.String())
			for _, name := range tc.bad {
				assert.Contains(t, out.String(), " ! ")
				assert.Contains(t, out.String(), name)
			}
			assert.Contains(t, out.String(), "FAIL: tests marked ! need root")

			// The same skips as another user are listed, not failed.
			out.Reset()
			assert.Equal(t, 0, run([]string{"skips", "-root", "no", dir}, nil, &out, &errb))
		})
	}
}

func TestSkipsNone(t *testing.T) {
	var out, errb bytes.Buffer
	require.Equal(t, 0, run([]string{"skips", writeDir(t, map[string]string{"go.json": noraceStream})}, nil, &out, &errb))
	assert.Equal(t, "skipped tests: none\n", out.String())
}

func TestUsageAndBadInput(t *testing.T) {
	for _, args := range [][]string{nil, {"tee"}, {"skips"}, {"skips", "-root", "maybe", "."}, {"frobnicate"}} {
		var out, errb bytes.Buffer
		assert.Equal(t, 2, run(args, nil, &out, &errb), "%v", args)
		assert.Contains(t, errb.String(), "usage:")
	}
	var out, errb bytes.Buffer
	dir := writeDir(t, map[string]string{"make.skip": "no tab here\n"})
	assert.Equal(t, 2, run([]string{"skips", dir}, nil, &out, &errb))
	assert.Contains(t, errb.String(), "want lines NAME<TAB>REASON")
	assert.Equal(t, 2, run([]string{"skips", filepath.Join(dir, "missing")}, nil, &out, &errb))
}

func TestTeeWritesFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "go.json")
	var out, errb bytes.Buffer
	assert.Equal(t, 0, run([]string{"tee", path}, strings.NewReader(noraceStream), &out, &errb))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, noraceStream, string(b))
	assert.Equal(t, 1, run([]string{"tee", path}, strings.NewReader(raceStream), &out, &errb))
}
