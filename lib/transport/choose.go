package transport

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// ChoiceError is a requested transport that cannot run the bridge.
type ChoiceError struct {
	Requested Kind
	Reason    string // why, in words
}

func (e *ChoiceError) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("bridge %q is not a transport (%s)", string(e.Requested), strings.Join(names(requestable), ", "))
	}
	return fmt.Sprintf("bridge %s was requested, but %s", e.Requested, e.Reason)
}

// Choose picks the transport of a bridge from the requested kind and where
// its members (the island leaders) run: auto ("" too) is shm when every
// member is on one host, else tcp; a built transport is taken as asked,
// shm only on one host. It returns the kind and the reason gbdiscover
// reports, or a *ChoiceError.
func Choose(requested Kind, members []MemberInfo) (Kind, string, error) {
	var hosts []string
	for _, m := range members {
		if !slices.Contains(hosts, m.Host) {
			hosts = append(hosts, m.Host)
		}
	}
	switch {
	case requested == Auto || requested == "":
		if len(hosts) == 1 {
			return SHM, fmt.Sprintf("auto: all %d leaders are on host %s", len(members), hosts[0]), nil
		}
		return TCP, fmt.Sprintf("auto: leaders are on %d hosts", len(hosts)), nil
	case !slices.Contains(requestable, requested):
		return "", "", &ChoiceError{Requested: requested}
	case drivers[requested] == nil:
		return "", "", &ChoiceError{Requested: requested, Reason: fmt.Sprintf("this gpubridge version has no %s transport yet (use %s)",
			requested, orList(offered()))}
	case requested == SHM && len(hosts) > 1:
		ranks := make([]string, len(members))
		for i, m := range members {
			ranks[i] = strconv.Itoa(m.Rank)
		}
		return "", "", &ChoiceError{Requested: SHM, Reason: fmt.Sprintf("the leaders (ranks %s) are on %d hosts (%s): shared memory needs one host",
			strings.Join(ranks, ","), len(hosts), strings.Join(hosts, ", "))}
	}
	return requested, "requested", nil
}

// offered are the kinds a user may ask for that this build runs.
func offered() []Kind {
	ks := []Kind{Auto}
	for _, k := range built() {
		if slices.Contains(requestable, k) {
			ks = append(ks, k)
		}
	}
	return ks
}
