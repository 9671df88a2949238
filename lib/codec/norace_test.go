//go:build !race

package codec

const raceOn = false
