package rendezvous

import (
	"context"
	"errors"
	"log/slog"
	"sync"
)

// Run joins the rendezvous (member 0 makes the job's secret, the others
// wait for it) and calls connect. While connect runs, a failure another
// member records cancels connect's context with a *RemoteError. Any other
// error, of joining or of connect, is recorded for the other members
// before Run returns it.
func Run(ctx context.Context, cfg Config, connect func(ctx context.Context, s *Session) error) error {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	s := &Session{cfg: cfg}
	err := s.run(ctx, connect)
	var re *RemoteError
	if err != nil && !errors.As(err, &re) {
		s.fail(ctx, err)
	}
	return err
}

func (s *Session) run(ctx context.Context, connect func(context.Context, *Session) error) error {
	if err := s.join(ctx); err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { s.watch(ctx, cancel) })
	defer wg.Wait()
	defer cancel(nil)
	return connect(ctx, s)
}
