package collective

// MinSpreadChunk is the smallest chunk SpreadChunk cuts: two of TCP's
// 512 KiB pieces, so that a frame's header and wake-ups are paid on a
// megabyte at least.
const MinSpreadChunk = 1 << 20

// SpreadChunk is the chunk a raw exchange or ring cuts a segment of L
// bytes into, with C the call's chunk (Options.ChunkBytes), streams data
// streams and es-byte elements: a segment of fewer than streams chunks of
// C leaves streams idle (a 16 MiB two-member all_reduce cut into 4 MiB
// chunks ran on 2 of 8 streams), so it is cut into one chunk per stream,
// whole elements, at least MinSpreadChunk and at most C. Members compute
// it from the same arguments, so their chunk lists agree. The bench's
// exchange ceiling cuts its frames the same way.
func SpreadChunk(L, C, streams, es int) int {
	per := (L + streams - 1) / streams
	per = (per + es - 1) / es * es
	floor := max(es, MinSpreadChunk-MinSpreadChunk%es)
	return max(es, min(C, max(per, floor)))
}
