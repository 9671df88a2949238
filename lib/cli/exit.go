// Package cli holds what every gpubridge tool shares: the exit-code
// convention, kong parsing with --version and the hidden man-page generator,
// and the bindings a command's Run method receives.
package cli

import (
	"errors"
	"fmt"
)

// Exit codes shared by every tool. Tools may add their own above these.
const (
	// ExitOK means the command ran and every check passed.
	ExitOK = 0
	// ExitFail means the command ran and the check or verdict failed.
	ExitFail = 1
	// ExitUsage means the command could not run: bad usage, I/O, setup.
	ExitUsage = 2
)

// ExitError carries the process exit code of an error.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit status %d", e.Code)
	}
	return e.Err.Error()
}

func (e *ExitError) Unwrap() error { return e.Err }

// WithCode wraps err so that the tool exits with code.
func WithCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &ExitError{Code: code, Err: err}
}

// Failed wraps err as a failed verdict (exit 1).
func Failed(err error) error { return WithCode(ExitFail, err) }

// CannotRun wraps err as "could not run" (exit 2).
func CannotRun(err error) error { return WithCode(ExitUsage, err) }

// Silent is an error that sets the exit code but prints nothing more: the
// command already reported on stderr.
func Silent(code int) error { return &ExitError{Code: code} }

// CodeOf returns the exit code err asks for: ExitOK for nil, the code of an
// ExitError in the chain, else ExitUsage.
func CodeOf(err error) int {
	if err == nil {
		return ExitOK
	}
	var ee *ExitError
	if errors.As(err, &ee) {
		return ee.Code
	}
	return ExitUsage
}
