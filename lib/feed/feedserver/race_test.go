//go:build race

package feedserver

const raceEnabled = true
