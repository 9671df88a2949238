// Package feedserver serves one feed connection for one bridge member: it
// drives a Bridge (*collective.Comm) with the requests the plugin sends.
//
// One goroutine reads the socket (read.go) and checks each request against
// the protocol, the mapped regions and the bridge (validate.go); a bad
// request gets a DONE with StatusBadRequest and nothing else happens.
// Collectives run one at a time in request order, the same order on every
// member (exec.go), while send and recv run on goroutines of their own.
// DONE and PROGRESS are written by the goroutine that has them, under a
// mutex (write.go). Regions are reference counted: a RELEASE is answered
// once no request uses the region (region.go). A failed collective breaks
// the bridge: every later request is refused at once with the original
// cause.
package feedserver
