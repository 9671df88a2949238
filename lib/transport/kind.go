package transport

import "strings"

// Kind names a bridge transport, as gbdiscover's --transport, gbbridge's
// --transport and the topology's bridge.transport spell it.
type Kind string

// Transport kinds. Auto is a request only: Choose turns it into TCP or SHM.
const (
	Auto  Kind = "auto"
	TCP   Kind = "tcp"
	SHM   Kind = "shm"
	Verbs Kind = "verbs"
	// Mem is the in-process transport of tests (NewMem); it is never
	// chosen.
	Mem Kind = "mem"
)

// requestable are the kinds a user may ask for, in the order messages list
// them.
var requestable = []Kind{Auto, TCP, SHM, Verbs}

// RequestableEnum is the kinds a user may ask for as a kong enum
// ("auto,tcp,shm,verbs"): the tools' --transport flags take it from here.
func RequestableEnum() string { return strings.Join(names(requestable), ",") }

func names(ks []Kind) []string {
	s := make([]string, len(ks))
	for i, k := range ks {
		s[i] = string(k)
	}
	return s
}

// orList joins kinds for messages: "tcp or shm", "auto, tcp or shm".
func orList(ks []Kind) string {
	s := names(ks)
	if len(s) < 2 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " or " + s[len(s)-1]
}
