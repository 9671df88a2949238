package testenv

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestScale(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want time.Duration
	}{
		{"", 2 * time.Second},
		{"3", 6 * time.Second},
		{"1.5", 3 * time.Second},
		{"0.1", 2 * time.Second}, // never shorter than written
		{"x", 2 * time.Second},
	} {
		t.Setenv(ScaleVar, tc.env)
		assert.Equal(t, tc.want, Scale(2*time.Second), "%s=%q", ScaleVar, tc.env)
	}
}
