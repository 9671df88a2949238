// Package feedtest is the reference client of the feed: what the torch
// plugin does in Python, in Go, for the tests of the server and of
// `gbbridge serve`, and for the latency measurements. It is safe for
// concurrent use.
package feedtest
