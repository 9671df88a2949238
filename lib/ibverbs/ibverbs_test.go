package ibverbs

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestGIDString(t *testing.T) {
	var g GID
	copy(g[10:], []byte{0xff, 0xff, 10, 0, 0, 1})
	assert.Equal(t, "10.0.0.1", g.IP().String())
	assert.Equal(t, "::ffff:10.0.0.1", g.String())
	assert.False(t, g.IsZero())
	assert.True(t, GID{}.IsZero())
	assert.Equal(t, 1024, MTU(3).Bytes())
	assert.Equal(t, 0, MTU(9).Bytes())
	assert.Equal(t, "RoCE v2", GIDTypeRoCEv2.String())
	assert.Equal(t, 100.0, PortAttr{ActiveWidth: 2, ActiveSpeed: 32}.Gbps())
}

func TestQPStateString(t *testing.T) {
	assert.Equal(t, "RTR", QPReadyToReceive.String())
	assert.Equal(t, "ERR", QPError.String())
	assert.Equal(t, "qp-state(9)", QPState(9).String())
}
