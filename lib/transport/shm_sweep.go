package transport

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// A member's ring file has a name only during set-up: it is unlinked after
// the set-up barrier, or when set-up fails. A member killed in between
// (SIGKILL, the OOM killer) runs no cleanup, and its file keeps its memory
// (about 100 MiB with the default rings) until the host reboots. So a
// member about to create its own file first removes those whose creator
// is gone.

// staleRingAge is how old a ring file must be before it may be swept. No
// set-up that is still running is that old unless it was given a timeout
// past an hour, and then the file's creator must also be gone.
const staleRingAge = time.Hour

// ringName is the name ringPath gives a ring file (sharePath adds ".sock").
var ringName = regexp.MustCompile(`^gpubridge-[0-9a-f]{16}-m[0-9]+$`)

// sweepStaleRings removes the ring files in dir, with their share sockets,
// that are this user's (mode 0600), older than staleRingAge at now, and
// whose creator (the pid in their header) runs no more in this pid
// namespace; a file without a header (its creator died before writing it)
// goes on its age alone, and so does a share socket without its ring file.
// It returns the paths it removed.
func sweepStaleRings(dir string, now time.Time) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var removed []string
	for _, e := range ents {
		if ring, ok := strings.CutSuffix(e.Name(), ".sock"); ok && ringName.MatchString(ring) {
			// A share socket whose ring file is gone: its member died
			// between the unlink of the one and of the other.
			path := filepath.Join(dir, e.Name())
			if _, err := os.Lstat(filepath.Join(dir, ring)); errors.Is(err, os.ErrNotExist) && staleSocket(path, now) {
				if os.Remove(path) == nil {
					removed = append(removed, path)
				}
			}
			continue
		}
		if !ringName.MatchString(e.Name()) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		if !staleRing(path, now) {
			continue
		}
		if err := os.Remove(path); err == nil {
			removed = append(removed, path)
		}
		_ = os.Remove(path + ".sock")
	}
	return removed
}

// staleRing says whether the ring file at path may be swept.
func staleRing(path string, now time.Time) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o777 != 0o600 || int(st.Uid) != os.Geteuid() {
		return false
	}
	if now.Sub(time.Unix(st.Mtim.Unix())) < staleRingAge {
		return false
	}
	var hb [shmHdrSize]byte
	n, _ := unix.Pread(fd, hb[:], 0)
	h, err := decodeSHMHeader(hb[:max(n, 0)])
	if err != nil {
		return true
	}
	return h.pid > 0 && errors.Is(unix.Kill(h.pid, 0), unix.ESRCH)
}

// staleSocket says whether the share socket at path, whose ring file is
// gone, may be swept: this user's, and older than staleRingAge.
func staleSocket(path string, now time.Time) bool {
	var st unix.Stat_t
	if unix.Lstat(path, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK || int(st.Uid) != os.Geteuid() {
		return false
	}
	return now.Sub(time.Unix(st.Mtim.Unix())) >= staleRingAge
}
