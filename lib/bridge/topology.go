package bridge

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"

	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/transport"
)

// MaxTopologyBytes bounds the topology JSON ReadTopology reads.
const MaxTopologyBytes = 16 << 20

// TopologyError is a topology that could not be read: what is wrong, and
// the underlying error if there is one.
type TopologyError struct {
	Problem string
	Err     error
}

func (e *TopologyError) Error() string {
	if e.Err == nil {
		return e.Problem
	}
	return e.Problem + ": " + e.Err.Error()
}

func (e *TopologyError) Unwrap() error { return e.Err }

// ReadTopology decodes gbdiscover's topology JSON. Errors are
// *TopologyError.
func ReadTopology(r io.Reader) (*discover.Topology, error) {
	b, err := io.ReadAll(io.LimitReader(r, MaxTopologyBytes+1))
	if err != nil {
		return nil, &TopologyError{"read topology", err}
	}
	if len(b) > MaxTopologyBytes {
		return nil, &TopologyError{Problem: fmt.Sprintf("topology is over %d bytes", MaxTopologyBytes)}
	}
	if len(b) == 0 {
		return nil, &TopologyError{Problem: "topology is empty (did gbdiscover succeed?)"}
	}
	var t discover.Topology
	if err := json.Unmarshal(b, &t); err != nil {
		if !json.Valid(b) {
			return nil, &TopologyError{"topology is not JSON", err}
		}
		return nil, &TopologyError{"topology is JSON, but not gbdiscover's topology", err}
	}
	if t.Schema != discover.TopologySchema {
		return nil, &TopologyError{Problem: fmt.Sprintf("topology has schema %q, want %q (gbdiscover's output on success)", t.Schema, discover.TopologySchema)}
	}
	return &t, nil
}

// Membership is this rank's place in the bridge a topology describes.
type Membership struct {
	Member    int
	Members   []transport.MemberInfo
	Transport transport.Kind
}

// MembershipError is a topology in which this rank cannot be a bridge
// member: the job has no bridge, its transport is unknown to this
// gbbridge, or the rank is not an island leader.
type MembershipError struct {
	Rank   int
	Reason string
}

func (e *MembershipError) Error() string { return e.Reason }

// FromTopology finds this rank's member index in the topology's bridge.
// Errors are *MembershipError.
func FromTopology(t *discover.Topology) (Membership, error) {
	b := t.Bridge
	refuse := func(format string, args ...any) (Membership, error) {
		return Membership{}, &MembershipError{Rank: t.Self.Rank, Reason: fmt.Sprintf(format, args...)}
	}
	if b.Transport == discover.BridgeNone || b.Transport == "" || len(b.Members) < 2 {
		return refuse("the job has no bridge (transport %q, %d member(s)): a single island needs no gbbridge", b.Transport, len(b.Members))
	}
	if run := transport.Runnable(); !slices.Contains(run, transport.Kind(b.Transport)) {
		return refuse("bridge transport %q is not supported by this gbbridge (%s)", b.Transport, transport.RunnableNames())
	}
	m := Membership{Member: -1, Transport: transport.Kind(b.Transport)}
	for i, rank := range b.Members {
		host := ""
		if i < len(b.Hosts) {
			host = b.Hosts[i]
		} else if rank >= 0 && rank < len(t.Ranks) {
			host = t.Ranks[rank].Hostname
		}
		m.Members = append(m.Members, transport.MemberInfo{Rank: rank, Host: host})
		if rank == t.Self.Rank {
			m.Member = i
		}
	}
	if m.Member < 0 {
		return refuse("rank %d is not a bridge member (the island leaders are ranks %v): only leaders run gbbridge serve", t.Self.Rank, b.Members)
	}
	return m, nil
}
