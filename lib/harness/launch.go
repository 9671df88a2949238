package harness

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/gpubridge/gpubridge/lib/store"
)

// Launch starts n member processes of this executable on this host, with an
// embedded store. args(rank, storeAddr) gives each member's arguments. The
// stdout of member 0 goes to stdout; every member's stderr goes to stderr
// with a "[member i] " prefix. Members die with this process. It returns
// once every member has exited, with the first failure.
func Launch(ctx context.Context, n int, args func(rank int, storeAddr string) []string, stdout, stderr io.Writer, log *slog.Logger) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("embedded store: listen: %w", err)
	}
	srv := store.NewServer(store.ServerOptions{Logger: log})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		<-served
	}()
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find own executable: %w", err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		errMu sync.Mutex // serialises stderr lines
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if first == nil {
			first = err
		}
	}
	cmds := make([]*exec.Cmd, n)
	for r := 0; r < n; r++ {
		cmd := exec.CommandContext(ctx, exe, args(r, ln.Addr().String())...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 5 * time.Second
		if r == 0 {
			cmd.Stdout = stdout
		}
		pipe, err := cmd.StderrPipe()
		if err != nil {
			return fmt.Errorf("member %d: %w", r, err)
		}
		if err := cmd.Start(); err != nil {
			for _, c := range cmds[:r] {
				_ = c.Process.Kill()
			}
			return fmt.Errorf("start member %d: %w", r, err)
		}
		cmds[r] = cmd
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := bufio.NewScanner(pipe)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				errMu.Lock()
				fmt.Fprintf(stderr, "[member %d] %s\n", r, sc.Text())
				errMu.Unlock()
			}
			if err := cmd.Wait(); err != nil {
				var ee *exec.ExitError
				if errors.As(err, &ee) {
					fail(&MemberExit{Rank: r, Code: ee.ExitCode()})
				} else {
					fail(fmt.Errorf("member %d: %w", r, err))
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// MemberExit is a member process that exited non-zero.
type MemberExit struct {
	Rank int
	Code int
}

func (e *MemberExit) Error() string {
	return "member " + strconv.Itoa(e.Rank) + " exited with status " + strconv.Itoa(e.Code)
}
