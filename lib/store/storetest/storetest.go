// Package storetest serves an in-process c10d store for the tests of the
// packages that use one (transport setup, discovery, the feed, gbbridge).
package storetest

import (
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/store"
)

// Start serves a store on a loopback port until the test ends and returns
// its address. The store must shut down cleanly.
func Start(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("storetest: listen: %v", err)
	}
	srv := store.NewServer(store.ServerOptions{})
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("storetest: shutdown: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("storetest: serve: %v", err)
		}
	})
	return ln.Addr().String()
}

// SyncBuffer is a log sink that goroutines may write at once.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
