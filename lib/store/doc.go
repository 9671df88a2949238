// Package store speaks the wire protocol of PyTorch's c10d TCPStore, the
// key-value store torch.distributed uses for rendezvous, as a client
// (Client, Dial) and as a server (Server). It interoperates with torch >= 2.8
// in both directions: torch ranks can use a Server as their store (for
// example with init_method="env://" and TORCHELASTIC_USE_AGENT_STORE=True),
// and a Client can talk to the TCPStore a torch master hosts (libuv or
// legacy backend).
//
// # Protocol
//
// Little-endian, no framing, no request ids: a client pipelines requests and
// the server answers in order. A request is a command byte followed by its
// arguments; strings and blobs are a u64 length plus raw bytes, key counts
// are u64, integers i64. Every torch 2.x client opens with VALIDATE (command
// 0 and the u32 magic 0x3C85F7CE, no reply) and PING (command 13 and a u32
// nonce that the server echoes). The commands this package implements, with
// their replies:
//
//	SET 1          key, value              -
//	COMPARE_SET 2  key, expected, desired  blob: the value now stored (see below)
//	GET 3          key                     blob (empty if the key is missing)
//	ADD 4          key, i64 delta          i64 new value (stored as ASCII decimal)
//	CHECK 5        n, n keys               u8 0 READY / 1 NOT_READY
//	WAIT 6         n, n keys               u8 0 STOP_WAITING once all keys exist
//	GETNUMKEYS 7   -                       i64 number of keys
//	DELETE_KEY 8   key                     i64 0 or 1
//	APPEND 9       key, value              -
//	MULTI_GET 10   n, n keys               n blobs
//	MULTI_SET 11   n, n (key, value)       -
//	CANCEL_WAIT 12 -                       u8 1 WAIT_CANCELED
//	PING 13        u32 nonce               u32 nonce
//	QUEUE_PUSH 14  key, value              -
//	QUEUE_POP 15   key                     i64 length before the pop, then the item if > 0
//	QUEUE_LEN 16   key                     i64
//	LIST_KEYS 17   -                       i64 n, n blobs (raw keys)
//
// COMPARE_SET follows torch: on a missing key an empty expected value creates
// the key and the reply is desired; a non-empty expected value stores nothing
// and the reply is expected. On an existing key the value is replaced only if
// it equals expected, and the reply is the value stored afterwards.
//
// # Key names
//
// torch's Python TCPStore puts "/" in front of every key, and PrefixStore
// joins prefix + "/" + key; Client does the same (see WireKey and
// Client.Prefix), so Client.Prefix("a").Set(ctx, "k", v) is
// PrefixStore("a", store).set("k", v). torch also uses the unprefixed key
// "init/": a master started with world_size counts the ranks that ADD it.
// Client cannot produce that key; users of the raw protocol must never ADD
// it.
//
// # Client
//
// Client keeps one connection and serializes requests on it. Blocking reads
// (Get, Wait, MultiGet) poll CHECK with exponential backoff (1 ms to 100 ms)
// instead of using the server-side WAIT, which keeps the connection in a
// known state when a deadline passes. Every operation has a deadline: ctx's,
// or the client timeout (WithTimeout, default 300 s like torch), whichever is
// earlier; it is also the connection's I/O deadline. Waiting operations that
// time out return an error wrapping ErrTimeout that names the missing keys.
// After an I/O error the connection is dropped and the next operation
// reconnects once. Requests over the protocol's limits (a value above 8 MiB,
// a key above 8 KiB, more than 131072 keys) are not sent: they fail with a
// *LimitError naming the limit, where the server would only have closed the
// connection. An address without host or port, or with port 0, fails Dial
// at once with an *AddrError (CheckAddr, ResolveAddr).
//
// # Server
//
// Server implements every command above for torch >= 2.8 clients, including
// server-side WAIT: waiters are woken by SET, ADD, APPEND, MULTI_SET and
// COMPARE_SET (when the key exists afterwards), and one waiter per
// QUEUE_PUSH, as torch does for blocking queue_pop. CANCEL_WAIT answers
// WAIT_CANCELED; a STOP_WAITING that was already due is sent before it, as
// torch's client expects. GET of a missing key answers an empty value (like
// torch's libuv server). Connections are served concurrently; each has a
// reader that executes requests in order and a writer, so a client that does
// not read cannot stall the store. Only the state change and the lookups of
// a request hold the store's lock: the values of a reply are referenced
// there and encoded after it is released.
//
// A connection that does not start with VALIDATE and the magic number (torch
// 1.13 clients, which send SET/ADD/GET directly or open an idle second
// socket) is closed after logging "gpubridge needs torch >= 2.8", at once or
// after ServerOptions.HandshakeTimeout.
//
// # Limits
//
// Every length and count is checked before memory is allocated for it, and
// memory is charged to the budget as the bytes arrive, not as announced: a
// client that announces an 8 MiB value and sends nothing holds nothing. A
// request with a key above MaxKeyLen (8 KiB), a value above MaxValueLen
// (8 MiB), more than MaxKeysPerRequest keys (131072), an unknown command, an
// ADD on a non-numeric value, or one that would take the server's memory
// (stored keys, values and queue items plus requests being decoded) over
// MaxTotalBytes (1 GiB) closes only that connection, with the reason logged.
// So does a request not complete within RequestTimeout (30 s) of its first
// byte; idle connections between requests have no deadline.
//
// Replies: one reply may not exceed MaxReplyBytes (64 MiB; a larger MULTI_GET,
// LIST_KEYS or GET closes its connection), a connection's reader stops while
// 1 MiB of its replies is unwritten, and the replies queued over all
// connections are bounded by MaxOutputBytes (256 MiB); a reply that finds no
// room waits its turn, first come first served. A client that does not read
// its replies within WriteTimeout (30 s) is closed. Connections above
// MaxConns (16384) are closed at once; a connection that does not send the
// handshake within HandshakeTimeout (30 s) is closed. Per connection the
// server also holds an 8 KiB read buffer and two goroutines.
//
// Warnings a peer can trigger (refused connections and requests, timeouts)
// are rate-limited per kind: 5 lines in 10 s, then one line "... and N more
// like this in the last 10s".
package store
