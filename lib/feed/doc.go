// Package feed is how the torch plugin feeds tensors to `gbbridge serve`:
// control messages on a Unix stream socket, data in shared-memory regions
// the plugin creates (memfd), pins (cudaHostRegister) and passes over the
// socket (SCM_RIGHTS), so the GPU-to-host copy lands in memory the bridge
// reads. docs/FEED.md is the protocol's specification; this package holds
// its codec (proto.go), the server that drives a Bridge (*collective.Comm)
// from one feed connection (Server), the reference client (Client) that
// the Python plugin mirrors, and RunServe, the body of `gbbridge serve`.
//
// # Server
//
// One goroutine reads the socket: it decodes and checks each request
// against the protocol, the mapped regions and the bridge (a bad request
// gets a DONE with StatusBadRequest and nothing else happens), resolves its
// spans to the mapped memory, and hands collectives to the executor
// goroutine, which runs them one at a time in request order (the same
// order on every member), while send and recv run on goroutines of their
// own. DONE and PROGRESS are written straight from the goroutine that has
// them, under a mutex; there is no writer goroutine. Regions are reference
// counted: a RELEASE is answered once no request uses the region. A
// failed collective breaks the bridge: every later request is refused at
// once with the original cause.
package feed

import "time"

// LatencyBudget is what the feed may add, at the median, to a 4-byte
// all_reduce round trip over the bare bridge (issue 3); tools/gbbridge's
// BenchmarkServeLatency (tools/gbbridge, make bench-latency) measures it
// through serve processes.
const LatencyBudget = 30 * time.Microsecond
