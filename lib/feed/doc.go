// Package feed is the protocol by which the torch plugin feeds tensors to
// `gbbridge serve`: control messages on a Unix stream socket, data in
// shared-memory regions the plugin creates (memfd), pins
// (cudaHostRegister) and passes over the socket (SCM_RIGHTS), so that the
// GPU-to-host copy lands in memory the bridge reads. docs/FEED.md is the
// specification. This package holds what both ends share: the messages and
// their codec, the limits, and the ready line serve prints. The server is
// feed/feedserver; the reference client, which the tests drive and the
// Python plugin mirrors, is feed/feedtest.
package feed

import "time"

// LatencyBudget is what the feed may add, at the median, to a 4-byte
// all_reduce round trip over the bare bridge (issue 3); tools/gbbridge's
// BenchmarkServeLatency (make bench-latency) measures it through serve
// processes.
const LatencyBudget = 30 * time.Microsecond
