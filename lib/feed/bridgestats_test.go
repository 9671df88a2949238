package feed

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func sampleBridgeStats() *BridgeStats {
	return &BridgeStats{
		Streams: 2, StartNS: 1000, AllArrivedNS: 1500, EndNS: 9000,
		BytesSent: 4 << 20, BytesReceived: 4 << 20, ReduceNS: 700,
		Peers: []BridgePeer{
			{Member: 0, ArrivalSkewNS: -300, BlockedNS: []uint64{10, 20}},
			{Member: 2, ArrivalSkewNS: 500, BlockedNS: []uint64{30, 40}},
		},
	}
}

func TestBridgeStatsRoundTrip(t *testing.T) {
	b := sampleBridgeStats()
	v := AppendBridgeStats(nil, b, MaxBridgeStatsValue)
	require.Len(t, v, 64+2*(16+16))
	le := binary.LittleEndian
	assert.Equal(t, uint16(1), le.Uint16(v))
	assert.Equal(t, uint16(2), le.Uint16(v[2:]))
	assert.Equal(t, uint16(2), le.Uint16(v[4:]))
	assert.Equal(t, uint64(1500), le.Uint64(v[16:]))
	assert.Equal(t, uint64(700), le.Uint64(v[56:]))
	assert.Equal(t, uint32(2), le.Uint32(v[64+32:]))
	assert.Equal(t, int64(-300), int64(le.Uint64(v[64+8:])))
	var got BridgeStats
	require.NoError(t, DecodeBridgeStats(v, &got))
	assert.Equal(t, b, &got)

	// It travels in DONE and fits there at the largest size.
	d := &DoneMsg{ID: 3, Seq: 4, Ext: []Ext{{Tag: ExtBridgeStats, Value: v}}}
	m, _, err := Decode(d.Append(nil))
	require.NoError(t, err)
	assert.Equal(t, d, m)
}

func TestBridgeStatsPeersCut(t *testing.T) {
	const s = 8
	b := &BridgeStats{Streams: s}
	for i := range MaxMembersForTest {
		b.Peers = append(b.Peers, BridgePeer{Member: uint32(i + 1), BlockedNS: make([]uint64, s)})
	}
	v := AppendBridgeStats(nil, b, MaxBridgeStatsValue)
	assert.LessOrEqual(t, len(v), MaxBridgeStatsValue)
	var got BridgeStats
	require.NoError(t, DecodeBridgeStats(v, &got))
	assert.Equal(t, BridgeStatsPeersCut, got.Flags&BridgeStatsPeersCut)
	assert.Len(t, got.Peers, 817, "as docs/TRACING.md §7 says for 8 streams")
	d := (&DoneMsg{ID: 1, Ext: []Ext{{Tag: ExtBridgeStats, Value: v}}}).Append(nil)
	assert.LessOrEqual(t, len(d), MaxMessage)
	_, _, err := Decode(d)
	require.NoError(t, err)

	// A limit below the fixed part still writes the fixed part.
	v = AppendBridgeStats(nil, b, 10)
	require.NoError(t, DecodeBridgeStats(v, &got))
	assert.Empty(t, got.Peers)
	assert.NotZero(t, got.Flags&BridgeStatsPeersCut)
}

// MaxMembersForTest is lib/collective.MaxMembers, less this member.
const MaxMembersForTest = 1023

func TestDecodeBridgeStatsLimits(t *testing.T) {
	good := AppendBridgeStats(nil, sampleBridgeStats(), MaxBridgeStatsValue)
	patch := func(off int, v uint16) []byte {
		b := bytes.Clone(good)
		binary.LittleEndian.PutUint16(b[off:], v)
		return b
	}
	cases := []struct {
		name    string
		v       []byte
		version bool
		want    string
	}{
		{"empty", nil, false, "0 bytes"},
		{"version 2", patch(0, 2), true, "version 2"},
		{"short fixed part", good[:40], false, "40 bytes, need 64"},
		{"no streams", patch(4, 0), false, "0 streams"},
		{"too many streams", patch(4, MaxBridgeStreams+1), false, "65 streams"},
		{"unknown flag", patch(6, 2), false, "flags 0x2"},
		{"one peer short", good[:len(good)-1], false, "take 128"},
		{"trailing byte", append(bytes.Clone(good), 0), false, "129 bytes"},
		{"more peers than bytes", patch(2, 3), false, "3 peers"},
		{"reserved word", func() []byte { b := bytes.Clone(good); b[64+4] = 1; return b }(), false, "reserved"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b BridgeStats
			err := DecodeBridgeStats(tc.v, &b)
			require.Error(t, err)
			if tc.version {
				assert.ErrorIs(t, err, ErrBridgeStatsVersion)
			} else {
				assert.ErrorIs(t, err, ErrMalformed)
			}
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

// FuzzBridgeStats feeds arbitrary tag-1 values to the decoder: it must
// never panic, and what it accepts must encode back to the same bytes.
func FuzzBridgeStats(f *testing.F) {
	f.Add(AppendBridgeStats(nil, sampleBridgeStats(), MaxBridgeStatsValue))
	f.Add(AppendBridgeStats(nil, &BridgeStats{Streams: 1}, MaxBridgeStatsValue))
	f.Fuzz(func(t *testing.T, v []byte) {
		var b BridgeStats
		if err := DecodeBridgeStats(v, &b); err != nil {
			return
		}
		if again := AppendBridgeStats(nil, &b, len(v)); !bytes.Equal(again, v) {
			t.Fatalf("re-encoded %x, decoded from %x", again, v)
		}
	})
}

var update = flag.Bool("update", false, "rewrite testdata/bridgestats")

// TestBridgeStatsVectors checks testdata/bridgestats: values (NAME.bin)
// with what they hold (NAME.json, the Go fields), which the plugin's
// decoder must read alike (torchplugin/tests/test_feed_protocol.py).
func TestBridgeStatsVectors(t *testing.T) {
	cut := sampleBridgeStats()
	vectors := map[string]struct {
		b     *BridgeStats
		limit int
	}{
		"two-peers": {sampleBridgeStats(), MaxBridgeStatsValue},
		"not-heard": {&BridgeStats{Streams: 1, StartNS: 5, AllArrivedNS: 5, EndNS: 6, Peers: []BridgePeer{{Member: 1, ArrivalSkewNS: BridgeNotHeard, BlockedNS: []uint64{0}}}}, MaxBridgeStatsValue},
		"cut":       {cut, 64 + 32},
	}
	for name, v := range vectors {
		bin := AppendBridgeStats(nil, v.b, v.limit)
		var got BridgeStats
		require.NoError(t, DecodeBridgeStats(bin, &got))
		js, err := json.MarshalIndent(&got, "", "  ")
		require.NoError(t, err)
		js = append(js, '\n')
		dir := filepath.Join("testdata", "bridgestats")
		if *update {
			require.NoError(t, os.MkdirAll(dir, 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(dir, name+".bin"), bin, 0o644))
			require.NoError(t, os.WriteFile(filepath.Join(dir, name+".json"), js, 0o644))
			continue
		}
		wantBin, err := os.ReadFile(filepath.Join(dir, name+".bin"))
		require.NoError(t, err, "run go test ./lib/feed -run Vectors -update")
		wantJS, err := os.ReadFile(filepath.Join(dir, name+".json"))
		require.NoError(t, err)
		assert.Equal(t, wantBin, bin, name)
		assert.JSONEq(t, string(wantJS), string(js), name)
	}
}
