package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/gpubridge/gpubridge/lib/bridge"
	"github.com/gpubridge/gpubridge/lib/discover"
	"github.com/gpubridge/gpubridge/lib/transport"
)

func TestFeedSpin(t *testing.T) {
	ranks := func(hosts ...string) []discover.RankInfo {
		out := make([]discover.RankInfo, len(hosts))
		for i, h := range hosts {
			out[i] = discover.RankInfo{Rank: i, Hostname: h}
		}
		return out
	}
	members := func(hosts ...string) []transport.MemberInfo {
		out := make([]transport.MemberInfo, len(hosts))
		for i, h := range hosts {
			out[i] = transport.MemberInfo{Rank: 2 * i, Host: h}
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		ranks   []discover.RankInfo
		bridge0 *bridge.Membership // nil: serve --no-bridge
		want    time.Duration
	}{
		{"one host, shm bridge 0", ranks("a", "a", "a", "a"), &bridge.Membership{Transport: transport.Auto, Members: members("a", "a")}, 200 * time.Microsecond},
		{"one host, no bridge 0", ranks("a", "a", "a", "a"), nil, 200 * time.Microsecond},
		{"one host, bridge 0 forced to tcp", ranks("a", "a", "a", "a"), &bridge.Membership{Transport: transport.TCP, Members: members("a", "a")}, 0},
		{"two hosts", ranks("a", "a", "b", "b"), &bridge.Membership{Transport: transport.Auto, Members: members("a", "b")}, 0},
		{"a non-leader on another host", ranks("a", "b", "a", "a"), nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &serving{c: &serveCmd{SpinUS: 200}, topo: &discover.Topology{}}
			s.topo.Ranks = tc.ranks
			s.topo.Self = tc.ranks[0]
			if tc.bridge0 != nil {
				s.ms, s.member = *tc.bridge0, &bridge.Member{}
			}
			assert.Equal(t, tc.want, s.feedSpin())
		})
	}
}
