package feed

import "encoding/binary"

// ExtFeedbackKey is the request extension FEEDBACK_KEY (version 3): tag 2,
// critical, so 0x8002 on the wire; its value is exactly FeedbackKeySize
// bytes, the key as a little-endian u64 (docs/FEED.md §3a). On a lossy
// all_reduce it names the buffer whose error-feedback residual the server
// keeps; the request codec decodes it into Request.FeedbackKey, so that it
// costs no allocation. Being critical, a server that predates it refuses
// it instead of ignoring it; the tag without the critical bit is malformed
// for the same reason (it would be skipped).
const ExtFeedbackKey uint16 = ExtCritical | 2

// FeedbackKeySize is the size of ExtFeedbackKey's value.
const FeedbackKeySize = 8

// ExtVersion is the feed protocol version that introduced a request
// extension (1 for those every version knows).
func ExtVersion(tag uint16) uint16 {
	switch tag {
	case ExtFeedbackKey:
		return 3
	case ExtBridge:
		return BridgesVersion
	}
	return 1
}

// AppendFeedbackKey appends the value of ExtFeedbackKey for key to dst.
func AppendFeedbackKey(dst []byte, key uint64) []byte {
	return binary.LittleEndian.AppendUint64(dst, key)
}

// DecodeFeedbackKey decodes the value of ExtFeedbackKey: exactly
// FeedbackKeySize bytes (ErrMalformed otherwise).
func DecodeFeedbackKey(v []byte) (uint64, error) {
	if len(v) != FeedbackKeySize {
		return 0, malformed("feedback key: value of %d bytes, want %d", len(v), FeedbackKeySize)
	}
	return binary.LittleEndian.Uint64(v), nil
}

// feedbackKey decodes a request's extension whose tag number is
// ExtFeedbackKey's into r.
func (d *dec) feedbackKey(tag uint16, v []byte, r *Request) {
	switch {
	case tag != ExtFeedbackKey:
		d.err = malformed("%s: feedback key extension (tag %d) without the critical bit (%#04x, want %#04x)", d.t, ExtFeedbackKey&^ExtCritical, tag, ExtFeedbackKey)
	case r.HasFeedbackKey:
		d.err = malformed("%s: two feedback key extensions", d.t)
	case len(v) != FeedbackKeySize:
		d.err = malformed("%s: feedback key: value of %d bytes, want %d", d.t, len(v), FeedbackKeySize)
	default:
		r.FeedbackKey, r.HasFeedbackKey = binary.LittleEndian.Uint64(v), true
	}
}
