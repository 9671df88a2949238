package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/gpubridge/gpubridge/lib/cli"
	"github.com/gpubridge/gpubridge/lib/store"
)

// ServeSchema is the schema of the line `gbdiscover serve` prints.
const ServeSchema = "gpubridge.store-serve/v1"

type serveCmd struct {
	Listen        string `help:"Address to listen on; port 0 picks a free port (printed on stdout)." env:"GPUBRIDGE_STORE_LISTEN" default:"127.0.0.1:29500"`
	DieWithParent bool   `help:"Exit when the parent process dies (PR_SET_PDEATHSIG)." default:"true" negatable:""`
	MaxValueBytes int    `help:"Largest value a client may store." default:"8388608"`
	MaxTotalBytes int64  `help:"Memory bound of all keys and values together." default:"1073741824"`
}

func (c *serveCmd) Run(env *cli.Env) error {
	if c.DieWithParent {
		if err := cli.DieWithParent(0); err != nil {
			return cli.CannotRun(err)
		}
	}
	return serve(env.Ctx, c, env.Log, env.Stdout)
}

// serve runs a c10d-compatible store until ctx ends. It prints one JSON
// line with the address it listens on once it accepts connections.
func serve(ctx context.Context, c *serveCmd, log *slog.Logger, stdout io.Writer) error {
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		return cli.CannotRun(fmt.Errorf("listen on %s: %w", c.Listen, err))
	}
	srv := store.NewServer(store.ServerOptions{MaxValueLen: c.MaxValueBytes, MaxTotalBytes: c.MaxTotalBytes, Logger: log})
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	line, _ := json.Marshal(map[string]string{"schema": ServeSchema, "listen": ln.Addr().String()})
	if _, err := fmt.Fprintf(stdout, "%s\n", line); err != nil {
		_ = srv.Shutdown(context.Background())
		<-done
		return cli.CannotRun(fmt.Errorf("write listen address: %w", err))
	}
	log.Info("store serving", "listen", ln.Addr().String())
	select {
	case err := <-done:
		if err != nil {
			return cli.CannotRun(fmt.Errorf("store server: %w", err))
		}
		return nil
	case <-ctx.Done():
	}
	log.Info("store shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return cli.CannotRun(fmt.Errorf("store shutdown: %w", err))
	}
	return <-done
}
