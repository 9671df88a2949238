package cli

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// DieWithParent asks the kernel to send this process SIGTERM when its parent
// dies (PR_SET_PDEATHSIG), so a tool spawned by a rank never outlives it. If
// the parent is already gone, it returns an error.
func DieWithParent() error {
	parent := os.Getppid()
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(syscall.SIGTERM), 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_PDEATHSIG): %w", err)
	}
	// The parent may have died before the prctl: then we were re-parented.
	if os.Getppid() != parent {
		return errors.New("parent process already exited")
	}
	return nil
}
