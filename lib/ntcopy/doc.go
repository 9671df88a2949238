// Package ntcopy copies large buffers with non-temporal (streaming) stores:
// the bytes go to memory through the write-combining buffers instead of
// through the caches. An ordinary store to a line that is not in cache
// first reads the line (a read for ownership), so an ordinary copy of a
// buffer that does not fit in the caches moves three bytes through memory
// per byte copied (read the source, read the destination, write it back);
// Copy moves two, and does not evict what the caches hold.
//
// Use it only where the destination will not be read again soon (the
// caller reads it after the whole collective, and it is too large to stay
// in cache): a streamed line has left the caches, so reading it back
// costs a trip to memory that an ordinary copy might have saved.
//
// Copy has copy's meaning and result. On amd64 with AVX the body is
// assembly (VMOVNTDQ, then SFENCE, so the bytes are visible to other cores
// and processes like those of an ordinary copy once Copy returns); the
// unaligned head and the tail, small buffers, overlapping ones and every
// other platform (and the purego build tag) use the built-in copy.
package ntcopy
