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
		{"verbs", Verbs, one, "", "", "bridge verbs was requested, but this gpubridge version has no verbs transport yet (use auto, tcp or shm)"},
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
