package transport

import (
	"context"
	"fmt"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
)

// Establish joins the bridge described by cfg: it shares the job's secret
// through the store, publishes this member's endpoint, checks that every
// member agrees on the settings, and connects to every other member the
// way cfg.Transport does. Any failure is written to the store, so that
// every member returns an error naming the cause within cfg.Timeout.
func Establish(ctx context.Context, cfg Config) (Mesh, error) {
	if err := cfg.normalize(); err != nil {
		return nil, fmt.Errorf("bridge setup: %w", err)
	}
	d := drivers[cfg.Transport]
	if d == nil {
		return nil, fmt.Errorf("bridge setup: unknown transport %q (%s)", string(cfg.Transport), orList(built()))
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	rcfg := rendezvous.Config{Store: cfg.Store, Scope: "bridge", Self: cfg.Self, Members: cfg.Members, Timeout: cfg.Timeout, Log: cfg.Log}
	var m Mesh
	err := rendezvous.Run(ctx, rcfg, func(ctx context.Context, rv *rendezvous.Session) error {
		s := &setup{cfg: cfg, rv: rv, log: cfg.Log, proto: cfg.proto, job: jobTag(rv.Secret())}
		var err error
		m, err = d.establish(ctx, s)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("bridge setup: %w", err)
	}
	cfg.Log.Info("bridge established", "member", cfg.Self, "members", len(cfg.Members), "transport", m.Describe())
	return m, nil
}
