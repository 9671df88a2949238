package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/alecthomas/kong"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/store"
	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// TestRunUsage: every usage error exits 2 at once, naming what is wrong
// (issue 9: --rank=-7 said "--rank is required"; issue 10: --store
// 127.0.0.1: was retried for 60 s).
func TestRunUsage(t *testing.T) {
	env := map[string]string{}
	base := func() runOptions {
		return runOptions{Store: "127.0.0.1:29500", Rank: 0, WorldSize: 4, Timeout: time.Minute,
			Getenv: func(k string) string { return env[k] }}
	}
	tests := []struct {
		name   string
		change func(o *runOptions)
		env    map[string]string
		want   string
	}{
		{"rank not given", func(o *runOptions) { o.Rank = unset }, nil, "--rank is required (or RANK / GPUBRIDGE_RANK)"},
		{"negative rank", func(o *runOptions) { o.Rank = -7 }, nil, "--rank -7: a rank must be >= 0 and < the world size (4)"},
		{"rank -1", func(o *runOptions) { o.Rank = -1 }, nil, "--rank -1: a rank must be >= 0 and < the world size (4)"},
		{"rank = world size", func(o *runOptions) { o.Rank = 4 }, nil, "--rank 4: a rank must be >= 0 and < the world size (4)"},
		{"world size not given", func(o *runOptions) { o.WorldSize = unset }, nil, "--world-size is required"},
		{"world size 0", func(o *runOptions) { o.WorldSize = 0 }, nil, "--world-size 0: the world size must be at least 1"},
		{"negative pid", func(o *runOptions) { o.PID = -3 }, nil, "--pid -3: a pid must be positive"},
		{"store without port", func(o *runOptions) { o.Store = "127.0.0.1:" }, nil,
			`--store: store address "127.0.0.1:": the port is missing (want HOST:PORT; is MASTER_PORT set?)`},
		{"store port 0", func(o *runOptions) { o.Store = "127.0.0.1:0" }, nil, "port 0 is no server's port"},
		{"store without host", func(o *runOptions) { o.Store = ":29500" }, nil, "the host is missing"},
		{"MASTER_PORT empty", func(o *runOptions) { o.Store = "" }, map[string]string{"MASTER_ADDR": "127.0.0.1"},
			"--store is required (or GPUBRIDGE_STORE, or MASTER_ADDR and MASTER_PORT; MASTER_PORT not set)"},
		{"MASTER_PORT 0", func(o *runOptions) { o.Store = "" }, map[string]string{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"},
			"port 0 is no server's port"},
		{"timeout", func(o *runOptions) { o.Timeout = 0 }, nil, "--timeout 0s must be positive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env = tt.env
			o := base()
			tt.change(&o)
			var stdout bytes.Buffer
			start := time.Now()
			err := run(context.Background(), o, strings.NewReader(""), &stdout)
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
	assert.True(t, errors.As(run(context.Background(), o, strings.NewReader(""), io.Discard), &ae))
}

// TestRunClaimsForParent: without --pid the claim names gbdiscover's
// parent (the rank process that runs it), else the pid given.
func TestRunClaimsForParent(t *testing.T) {
	for _, pid := range []int{0, os.Getpid()} {
		o := runOptions{Store: "127.0.0.1:1", Rank: 0, WorldSize: 1, Timeout: time.Second, PID: pid}
		require.NoError(t, o.resolve())
		want := pid
		if pid == 0 {
			want = os.Getppid()
		}
		assert.Equal(t, want, o.PID)
	}
}

// TestTransportFlag: --transport (GPUBRIDGE_BRIDGE) is the bridge
// transport asked for, as gbbridge names it; --bridge, its old name, still
// works and is not shown.
func TestTransportFlag(t *testing.T) {
	tests := []struct {
		args []string
		env  string
		want transport.Kind
	}{
		{nil, "", transport.Auto},
		{[]string{"--transport", "tcp"}, "", transport.TCP},
		{[]string{"--bridge", "shm"}, "", transport.SHM},
		{nil, "tcp", transport.TCP},
		{[]string{"--transport=verbs"}, "shm", transport.Verbs},
	}
	for _, tt := range tests {
		t.Setenv("GPUBRIDGE_BRIDGE", tt.env)
		if tt.env == "" {
			require.NoError(t, os.Unsetenv("GPUBRIDGE_BRIDGE"))
		}
		var g grammar
		k, err := kong.New(&g, kong.Vars(tool.Vars), kong.Exit(func(int) { t.Fatal("exit") }))
		require.NoError(t, err)
		_, err = k.Parse(append([]string{"run"}, tt.args...))
		require.NoError(t, err, tt.args)
		assert.Equal(t, tt.want, transport.Kind(g.Run.Transport), "%v %s", tt.args, tt.env)
	}
	var help bytes.Buffer
	var g grammar
	k, err := kong.New(&g, kong.Vars(tool.Vars), kong.Writers(&help, &help), kong.Exit(func(int) {}))
	require.NoError(t, err)
	_, _ = k.Parse([]string{"run", "--help"})
	assert.Contains(t, help.String(), "--transport=")
	assert.NotContains(t, help.String(), "--bridge")
	// The flag's choices are lib/transport's requestable kinds, no copy.
	_, err = k.Parse([]string{"run", "--transport", "rdma"})
	require.Error(t, err)
	kinds := strings.Split(transport.RequestableEnum(), ",")
	assert.Contains(t, err.Error(), `"`+strings.Join(kinds, `","`)+`"`)
	assert.Contains(t, kinds, string(transport.Verbs))
	for _, kind := range kinds {
		_, err = k.Parse([]string{"run", "--transport", kind})
		require.NoError(t, err, kind)
	}
}
