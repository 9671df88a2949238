package cli

import (
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// DieWithParent asks the kernel to send this process SIGTERM when its parent
// dies (PR_SET_PDEATHSIG), so a tool spawned by a rank never outlives it. If
// the parent is already gone, it returns an error. parent is the pid the
// spawner gave (its own): with it, a parent that died between fork and this
// call is caught too; 0 takes the parent found at this call.
func DieWithParent(parent int) error {
	if parent <= 0 {
		parent = os.Getppid()
	}
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(syscall.SIGTERM), 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_PDEATHSIG): %w", err)
	}
	// The parent may have died before the prctl: then we were re-parented.
	if ppid := os.Getppid(); ppid != parent {
		return fmt.Errorf("parent process %d already exited (the parent is now pid %d)", parent, ppid)
	}
	return nil
}
