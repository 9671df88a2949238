package discover

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/testenv"
)

// TestRunCLIUsage: every usage error exits 2 at once, naming what is wrong
// (issue 9: --rank=-7 said "--rank is required"; issue 10: --store
// 127.0.0.1: was retried for 60 s).
func TestRunCLIUsage(t *testing.T) {
	env := map[string]string{}
	base := func() RunOptions {
		return RunOptions{Store: "127.0.0.1:29500", Rank: 0, WorldSize: 4, LocalRank: -1, Timeout: time.Minute,
			Getenv: func(k string) string { return env[k] }}
	}
	tests := []struct {
		name   string
		change func(o *RunOptions)
		env    map[string]string
		want   string
	}{
		{"rank not given", func(o *RunOptions) { o.Rank = Unset }, nil, "--rank is required (or RANK / GPUBRIDGE_RANK)"},
		{"negative rank", func(o *RunOptions) { o.Rank = -7 }, nil, "--rank -7: a rank must be >= 0 and < the world size (4)"},
		{"rank -1", func(o *RunOptions) { o.Rank = -1 }, nil, "--rank -1: a rank must be >= 0 and < the world size (4)"},
		{"rank = world size", func(o *RunOptions) { o.Rank = 4 }, nil, "--rank 4: a rank must be >= 0 and < the world size (4)"},
		{"world size not given", func(o *RunOptions) { o.WorldSize = Unset }, nil, "--world-size is required"},
		{"world size 0", func(o *RunOptions) { o.WorldSize = 0 }, nil, "--world-size 0: the world size must be at least 1"},
		{"negative pid", func(o *RunOptions) { o.PID = -3 }, nil, "--pid -3: a pid must be positive"},
		{"store without port", func(o *RunOptions) { o.Store = "127.0.0.1:" }, nil,
			`--store: store address "127.0.0.1:": the port is missing (want HOST:PORT; is MASTER_PORT set?)`},
		{"store port 0", func(o *RunOptions) { o.Store = "127.0.0.1:0" }, nil, "port 0 is no server's port"},
		{"store without host", func(o *RunOptions) { o.Store = ":29500" }, nil, "the host is missing"},
		{"MASTER_PORT empty", func(o *RunOptions) { o.Store = "" }, map[string]string{"MASTER_ADDR": "127.0.0.1"},
			"--store is required (or GPUBRIDGE_STORE, or MASTER_ADDR and MASTER_PORT; MASTER_PORT not set)"},
		{"MASTER_PORT 0", func(o *RunOptions) { o.Store = "" }, map[string]string{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"},
			"port 0 is no server's port"},
		{"timeout", func(o *RunOptions) { o.Timeout = 0 }, nil, "--timeout 0s must be positive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env = tt.env
			o := base()
			tt.change(&o)
			var stdout, stderr bytes.Buffer
			start := time.Now()
			err := RunCLI(context.Background(), o, strings.NewReader(""), &stdout, &stderr)
			require.Error(t, err)
			assert.Equal(t, cli.ExitUsage, cli.CodeOf(err), "%v", err)
			assert.Contains(t, err.Error(), tt.want)
			assert.Less(t, time.Since(start), testenv.Scale(5*time.Second), "a usage error fails at once")
			assert.Empty(t, stdout.String())
		})
	}
	// The store address error is typed.
	o := base()
	o.Store = "h:"
	var ae *store.AddrError
	assert.True(t, errors.As(RunCLI(context.Background(), o, strings.NewReader(""), &bytes.Buffer{}, &bytes.Buffer{}), &ae))
}

// TestRunCLIClaimsForParent: without --pid the claim names gbdiscover's
// parent (the rank process that runs it), else the pid given.
func TestRunCLIClaimsForParent(t *testing.T) {
	for _, pid := range []int{0, os.Getpid()} {
		o := RunOptions{Store: "127.0.0.1:1", Rank: 0, WorldSize: 1, Timeout: time.Second, PID: pid}
		require.NoError(t, o.resolve())
		want := pid
		if pid == 0 {
			want = os.Getppid()
		}
		assert.Equal(t, want, o.PID)
	}
}
