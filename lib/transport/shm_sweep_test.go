package transport

import (
	"encoding/binary"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// deadPid returns the pid of a process that has exited and been reaped.
func deadPid(t *testing.T) int {
	t.Helper()
	c := exec.Command("true")
	require.NoError(t, c.Run())
	return c.Process.Pid
}

func TestSweepStaleRings(t *testing.T) {
	dead, alive := deadPid(t), os.Getpid()
	old := time.Now().Add(-2 * staleRingAge)
	header := func(pid int) []byte {
		b := make([]byte, shmHdrSize)
		copy(b, shmMagic)
		binary.LittleEndian.PutUint32(b[16:], uint32(pid))
		return b
	}
	cases := []struct {
		name    string
		file    string
		content []byte
		mode    os.FileMode
		mtime   time.Time
		swept   bool
	}{
		{"old, its creator dead", "gpubridge-0123456789abcdef-m0", header(dead), 0o600, old, true},
		{"old, no header (its creator died before writing it)", "gpubridge-0123456789abcdee-m1", nil, 0o600, old, true},
		{"old, its creator alive (a set-up given a long timeout)", "gpubridge-0123456789abcded-m0", header(alive), 0o600, old, false},
		{"young, its creator dead (it may be a set-up of another pid namespace)", "gpubridge-0123456789abcdec-m0", header(dead), 0o600, time.Now(), false},
		{"not a ring file's name", "gpubridge-0123456789abcdeb-m0.data", header(dead), 0o600, old, false},
		{"another mode: not one of ours", "gpubridge-0123456789abcdea-m0", header(dead), 0o644, old, false},
	}
	dir := t.TempDir()
	for _, c := range cases {
		p := filepath.Join(dir, c.file)
		require.NoError(t, os.WriteFile(p, c.content, c.mode))
		require.NoError(t, os.Chmod(p, c.mode))
		require.NoError(t, os.WriteFile(p+".sock", nil, 0o600))
		require.NoError(t, os.Chtimes(p, c.mtime, c.mtime))
	}
	// Share sockets whose ring file is gone: an old one goes, a young one
	// (its member between the two unlinks) stays. (Real sockets: the
	// sweep checks the type.)
	lone := func(name string, mtime time.Time) string {
		p := filepath.Join(dir, name)
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
		require.NoError(t, err)
		l.SetUnlinkOnClose(false)
		require.NoError(t, l.Close())
		require.NoError(t, os.Chtimes(p, mtime, mtime))
		return p
	}
	oldSock := lone("gpubridge-0123456789abcde9-m1.sock", old)
	youngSock := lone("gpubridge-0123456789abcde8-m1.sock", time.Now())
	removed := sweepStaleRings(dir, time.Now())
	assert.NoFileExists(t, oldSock)
	_, err := os.Lstat(youngSock)
	assert.NoError(t, err, "a young share socket was swept")
	var want []string
	for _, c := range cases {
		p := filepath.Join(dir, c.file)
		_, err := os.Stat(p)
		_, serr := os.Stat(p + ".sock")
		if c.swept {
			want = append(want, p)
			assert.True(t, os.IsNotExist(err), "%s: not swept", c.name)
			assert.True(t, os.IsNotExist(serr), "%s: its socket not swept", c.name)
		} else {
			assert.NoError(t, err, "%s: swept", c.name)
			assert.NoError(t, serr, "%s: its socket swept", c.name)
		}
	}
	assert.ElementsMatch(t, append(want, oldSock), removed)
}
