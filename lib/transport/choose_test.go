package transport

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestChoose(t *testing.T) {
	one := []MemberInfo{{Rank: 0, Host: "h0"}, {Rank: 2, Host: "h0"}}
	two := []MemberInfo{{Rank: 0, Host: "h0"}, {Rank: 2, Host: "h1"}, {Rank: 3, Host: "h1"}}
	tests := []struct {
		name      string
		requested Kind
		members   []MemberInfo
		kind      Kind
		reason    string
		err       string
	}{
		{"auto on one host", Auto, one, SHM, "auto: all 2 leaders are on host h0", ""},
		{"auto on two hosts", Auto, two, TCP, "auto: leaders are on 2 hosts", ""},
		{"unset is auto", "", one, SHM, "auto: all 2 leaders are on host h0", ""},
		{"tcp on one host", TCP, one, TCP, "requested", ""},
		{"shm on one host", SHM, one, SHM, "requested", ""},
		{"shm on two hosts", SHM, two, "", "", "bridge shm was requested, but the leaders (ranks 0,2,3) are on 2 hosts (h0, h1): shared memory needs one host"},
		{"verbs", Verbs, one, Verbs, "requested", ""},
		{"mem is for tests only", Mem, one, "", "", `bridge "mem" is not a transport (auto, tcp, shm, verbs)`},
		{"unknown", "carrier-pigeon", one, "", "", `bridge "carrier-pigeon" is not a transport (auto, tcp, shm, verbs)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, reason, err := Choose(tt.requested, tt.members)
			if tt.err != "" {
				var ce *ChoiceError
				require.ErrorAs(t, err, &ce)
				assert.EqualError(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.kind, k)
			assert.Equal(t, tt.reason, reason)
		})
	}
}

// What the leaders' nodes offer RDMA decides auto across hosts: verbs only
// when every one has a port libibverbs opens on a shared link layer; the
// reason says why not.
func TestChooseForRDMA(t *testing.T) {
	two := []MemberInfo{{Rank: 0, Host: "h0"}, {Rank: 2, Host: "h1"}}
	roce := func(dev string) RDMAOffer {
		return RDMAOffer{Probed: true, Ports: []RDMAPortOffer{{Device: dev, Port: 1, LinkLayer: "Ethernet"}}}
	}
	ib := RDMAOffer{Probed: true, Ports: []RDMAPortOffer{{Device: "mlx5_0", Port: 1, LinkLayer: "InfiniBand"}}}
	both := RDMAOffer{Probed: true, Ports: []RDMAPortOffer{{Device: "mlx5_0", Port: 1, LinkLayer: "InfiniBand"}, {Device: "mlx5_1", Port: 1, LinkLayer: "Ethernet"}}}
	tests := []struct {
		name      string
		requested Kind
		members   []MemberInfo
		rdma      []RDMAOffer
		kind      Kind
		reason    string
		err       string
	}{
		{"auto, RoCE everywhere", Auto, two, []RDMAOffer{roce("rxe0"), roce("rxe1")}, Verbs,
			"auto: leaders are on 2 hosts, each with an active Ethernet port that libibverbs opens (rank 0: rxe0 port 1, rank 2: rxe1 port 1)", ""},
		{"auto, a shared link layer", Auto, two, []RDMAOffer{both, ib}, Verbs,
			"auto: leaders are on 2 hosts, each with an active InfiniBand port that libibverbs opens (rank 0: mlx5_0 port 1, rank 2: mlx5_0 port 1)", ""},
		{"auto, one without", Auto, two, []RDMAOffer{roce("rxe0"), {Probed: true, Why: "libibverbs is unavailable"}}, TCP,
			"auto: leaders are on 2 hosts; tcp, not verbs: rank 2 on h1 has no active RDMA port that libibverbs opens (libibverbs is unavailable)", ""},
		{"auto, not probed", Auto, two, []RDMAOffer{roce("rxe0"), {}}, TCP,
			"auto: leaders are on 2 hosts; tcp, not verbs: rank 2 on h1: libibverbs was not consulted", ""},
		{"auto, different link layers", Auto, two, []RDMAOffer{roce("rxe0"), ib}, TCP,
			"auto: leaders are on 2 hosts; tcp, not verbs: the leaders' ports are on different link layers (rank 0 on h0: Ethernet; rank 2 on h1: InfiniBand)", ""},
		{"auto on one host stays shm", Auto, []MemberInfo{{Rank: 0, Host: "h0"}, {Rank: 1, Host: "h0"}}, []RDMAOffer{roce("rxe0"), roce("rxe0")}, SHM,
			"auto: all 2 leaders are on host h0", ""},
		{"verbs forced", Verbs, two, []RDMAOffer{roce("rxe0"), roce("rxe1")}, Verbs, "requested", ""},
		{"verbs forced, unknown", Verbs, two, []RDMAOffer{{}, {}}, Verbs, "requested", ""},
		{"verbs forced, none", Verbs, two, []RDMAOffer{roce("rxe0"), {Probed: true}}, "", "",
			"bridge verbs was requested, but rank 2 on h1 has no active RDMA port that libibverbs opens"},
		{"tcp forced", TCP, two, []RDMAOffer{roce("rxe0"), roce("rxe1")}, TCP, "requested", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, reason, err := ChooseFor(tt.requested, tt.members, tt.rdma)
			if tt.err != "" {
				assert.EqualError(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.kind, k)
			assert.Equal(t, tt.reason, reason)
		})
	}
}
