// Package maketest checks the Makefile's promises that tests can see.
package maketest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// make demo prints JSON lines on stdout; the build it runs first must keep
// its command echo off stdout (it once printed "go build ..." among them).
// The build goes to a temporary BIN, so the tools other tests run stay put.
func TestBuildKeepsStdoutForData(t *testing.T) {
	mk, err := exec.LookPath("make")
	require.NoError(t, err, "make is needed (ci/deps.sh installs it)")
	bin := t.TempDir()
	cmd := exec.Command(mk, "--no-print-directory", "build", "BIN="+bin)
	cmd.Dir = filepath.Join("..", "..")
	// A make test run passes its flags down (-s would hide the echo anyway).
	cmd.Env = append(os.Environ(), "MAKEFLAGS=", "MFLAGS=", "MAKELEVEL=")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "make build: %s", stderr.String())
	assert.Empty(t, stdout.String(), "make build printed on stdout")
	assert.Contains(t, stderr.String(), " build -trimpath -o "+bin+"/", "the build command is still shown, on stderr")
	for _, tool := range []string{"gbprobe", "gbdiscover", "gbbridge"} {
		assert.FileExists(t, filepath.Join(bin, tool))
	}
}
