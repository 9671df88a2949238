package transport

import (
	"context"
	"slices"
	"strings"
)

// A driver is one transport as Establish runs it (NCCL's struct
// ncclTransport). Each transport's setup file registers its driver from
// an init function, so a transport plugs in by adding its own files.
type driver struct {
	kind Kind
	// establish publishes this member's endpoint, gathers every member's,
	// connects and returns the mesh, within ctx (which another member's
	// recorded failure cancels).
	establish func(ctx context.Context, s *setup) (Mesh, error)
}

var drivers = map[Kind]*driver{}

func register(d *driver) {
	if drivers[d.kind] != nil {
		panic("transport: " + string(d.kind) + " registered twice")
	}
	drivers[d.kind] = d
}

// built lists the kinds Establish can run, in requestable order (then
// others, such as test transports, by name).
func built() []Kind {
	var ks []Kind
	for k := range drivers {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b Kind) int {
		ia, ib := slices.Index(requestable, a), slices.Index(requestable, b)
		switch {
		case ia >= 0 && ib >= 0:
			return ia - ib
		case ia >= 0:
			return -1
		case ib >= 0:
			return 1
		}
		return strings.Compare(string(a), string(b))
	})
	return ks
}

// Runnable lists the kinds a topology may name for Establish to run: the
// requestable ones this binary has a driver for (auto is a request, not a
// kind that runs).
func Runnable() []Kind {
	var ks []Kind
	for _, k := range built() {
		if k != Auto && slices.Contains(requestable, k) {
			ks = append(ks, k)
		}
	}
	return ks
}

// RunnableNames is Runnable as a list for messages ("tcp, shm").
func RunnableNames() string { return strings.Join(names(Runnable()), ", ") }
