package store

import "strings"

// WireKey returns the key that torch's Python TCPStore client sends for key
// when it is reached through PrefixStores with the given prefixes, outermost
// store's prefix first: PrefixStore(p2, PrefixStore(p1, tcpStore)).set(key)
// corresponds to WireKey([]string{p1, p2}, key).
//
// TCPStore puts "/" in front of every key and each PrefixStore joins
// prefix + "/" + key, so the result is "/" + p1 + "/" + p2 + "/" + key.
// Empty prefixes are kept (PrefixStore("", s) really does add "/").
func WireKey(prefixes []string, key string) string {
	var b strings.Builder
	n := 1 + len(key)
	for _, p := range prefixes {
		n += len(p) + 1
	}
	b.Grow(n)
	b.WriteByte('/')
	for _, p := range prefixes {
		b.WriteString(p)
		b.WriteByte('/')
	}
	b.WriteString(key)
	return b.String()
}
