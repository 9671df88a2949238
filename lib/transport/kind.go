package transport

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

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

// Requestable are the kinds a user may ask for, in the order messages list
// them.
var Requestable = []Kind{Auto, TCP, SHM, Verbs}

// ChoiceError is a requested transport that cannot run the bridge.
type ChoiceError struct {
	Requested Kind
	Reason    string // why, in words
}

func (e *ChoiceError) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("bridge %q is not a transport (%s)", string(e.Requested), kindList(Requestable))
	}
	return fmt.Sprintf("bridge %s was requested, but %s", e.Requested, e.Reason)
}

// Choose picks the transport of a bridge from the requested kind and where
// its members (the island leaders) run: auto ("" too) is shm when every
// member is on one host, else tcp; tcp and shm are taken as asked, shm only
// on one host. It returns the kind and the reason gbdiscover reports, or a
// *ChoiceError.
func Choose(requested Kind, members []MemberInfo) (Kind, string, error) {
	var hosts []string
	for _, m := range members {
		if !slices.Contains(hosts, m.Host) {
			hosts = append(hosts, m.Host)
		}
	}
	switch requested {
	case Auto, "":
		if len(hosts) == 1 {
			return SHM, fmt.Sprintf("auto: all %d leaders are on host %s", len(members), hosts[0]), nil
		}
		return TCP, fmt.Sprintf("auto: leaders are on %d hosts", len(hosts)), nil
	case SHM:
		if len(hosts) > 1 {
			ranks := make([]string, len(members))
			for i, m := range members {
				ranks[i] = strconv.Itoa(m.Rank)
			}
			return "", "", &ChoiceError{Requested: SHM, Reason: fmt.Sprintf("the leaders (ranks %s) are on %d hosts (%s): shared memory needs one host",
				strings.Join(ranks, ","), len(hosts), strings.Join(hosts, ", "))}
		}
		return SHM, "requested", nil
	case TCP:
		return TCP, "requested", nil
	case Verbs:
		return "", "", &ChoiceError{Requested: Verbs, Reason: "this gpubridge version has no verbs transport yet (use auto, tcp or shm)"}
	}
	return "", "", &ChoiceError{Requested: requested}
}

func kindList(ks []Kind) string {
	s := make([]string, len(ks))
	for i, k := range ks {
		s[i] = string(k)
	}
	return strings.Join(s, ", ")
}
