package main

import (
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func heapGoal() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/goal:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// rss is this process's resident set in bytes (/proc/self/statm).
func rss(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/statm")
	require.NoError(t, err)
	f := strings.Fields(string(b))
	require.GreaterOrEqual(t, len(f), 2)
	pages, err := strconv.ParseInt(f[1], 10, 64)
	require.NoError(t, err)
	return pages * int64(os.Getpagesize())
}

func TestGCBallast(t *testing.T) {
	defer func() { gcBallast = nil; runtime.GC() }()
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }

	env["GOGC"] = "100"
	assert.Zero(t, setGCBallast(getenv), "GOGC set: the user tunes the collector")
	delete(env, "GOGC")
	env["GOMEMLIMIT"] = "1GiB"
	assert.Zero(t, setGCBallast(getenv), "GOMEMLIMIT set: the user tunes the collector")
	delete(env, "GOMEMLIMIT")

	before := rss(t)
	require.Equal(t, serveBallast, setGCBallast(getenv))
	runtime.GC()
	assert.Less(t, rss(t)-before, int64(serveBallast/4), "the ballast is never written: it costs no resident memory")
	assert.GreaterOrEqual(t, heapGoal(), uint64(2*serveBallast), "the ballast raises the heap goal")
}
