package discover

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

// ServeOptions configure the embedded store server.
type ServeOptions struct {
	Listen        string
	DieWithParent bool
	MaxValueBytes int
	MaxTotalBytes int64
	Log           *slog.Logger
}

// Serve runs a c10d-compatible store until ctx ends. It prints one JSON line
// with the address it listens on once it accepts connections.
func Serve(ctx context.Context, o ServeOptions, stdout io.Writer) error {
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.DieWithParent {
		if err := cli.DieWithParent(); err != nil {
			return cli.CannotRun(err)
		}
	}
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		return cli.CannotRun(fmt.Errorf("listen on %s: %w", o.Listen, err))
	}
	srv := store.NewServer(store.ServerOptions{MaxValueLen: o.MaxValueBytes, MaxTotalBytes: o.MaxTotalBytes, Logger: o.Log})
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	line, _ := json.Marshal(map[string]string{"schema": ServeSchema, "listen": ln.Addr().String()})
	if _, err := fmt.Fprintf(stdout, "%s\n", line); err != nil {
		_ = srv.Shutdown(context.Background())
		<-done
		return cli.CannotRun(fmt.Errorf("write listen address: %w", err))
	}
	o.Log.Info("store serving", "listen", ln.Addr().String())
	select {
	case err := <-done:
		if err != nil {
			return cli.CannotRun(fmt.Errorf("store server: %w", err))
		}
		return nil
	case <-ctx.Done():
	}
	o.Log.Info("store shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return cli.CannotRun(fmt.Errorf("store shutdown: %w", err))
	}
	return <-done
}
