// Package harness is what gbbridge's selftest and bench run on joined
// bridge members (bridge.Join): the selftest's checks of every collective,
// dtype and op, bit for bit (selftest.go, data.go), the bench's sweep in
// nccl-tests' columns with its anchors, the raw exchange and memcpy
// (bench.go, exchange.go, sizes.go), and Launch, which starts members as
// processes of this executable over an embedded c10d store.
package harness
