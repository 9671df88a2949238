//go:build !race

package feedserver

const raceEnabled = false
