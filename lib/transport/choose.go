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

// RDMAOffer is what a member's node offers the verbs transport, from its
// gbprobe report: the active ports that libibverbs opens.
type RDMAOffer struct {
	// Probed is false when libibverbs was not consulted (then nothing is
	// known); Why says what libibverbs answered when it had no port.
	Probed bool
	Ports  []RDMAPortOffer
	Why    string
}

// RDMAPortOffer is one usable port: "rxe0" port 1 on "Ethernet".
type RDMAPortOffer struct {
	Device    string
	Port      int
	LinkLayer string
}

// Choose picks the transport of a bridge from the requested kind and where
// its members (the island leaders) run: auto ("" too) is shm when every
// member is on one host, else tcp; a built transport is taken as asked,
// shm only on one host. It returns the kind and the reason gbdiscover
// reports, or a *ChoiceError.
func Choose(requested Kind, members []MemberInfo) (Kind, string, error) {
	return ChooseFor(requested, members, nil)
}

// ChooseFor is Choose knowing what each member's node offers RDMA (rdma[i]
// for members[i]; nil: unknown): auto across hosts is verbs when every
// member has an active port that libibverbs opens, all on one link layer,
// else tcp, with the reason verbs was not taken; verbs asked for is refused
// naming a member whose node is known to have no such port.
func ChooseFor(requested Kind, members []MemberInfo, rdma []RDMAOffer) (Kind, string, error) {
	k, reason, err := choose(requested, members)
	if err != nil || rdma == nil || len(rdma) != len(members) || drivers[Verbs] == nil {
		return k, reason, err
	}
	ll, why := commonLinkLayer(members, rdma)
	known := !slices.ContainsFunc(rdma, func(o RDMAOffer) bool { return !o.Probed })
	lacking := slices.ContainsFunc(rdma, func(o RDMAOffer) bool { return o.Probed && len(o.Ports) == 0 })
	switch {
	case requested == Verbs && ll == "" && (known || lacking):
		// Known not to work; unknown nodes are left to the set-up.
		return "", "", &ChoiceError{Requested: Verbs, Reason: why}
	case k == TCP && (requested == Auto || requested == ""):
		if ll == "" {
			return TCP, reason + "; tcp, not verbs: " + why, nil
		}
		var ports []string
		for i, o := range rdma {
			ports = append(ports, fmt.Sprintf("rank %d: %s port %d", members[i].Rank, o.Ports[0].Device, o.Ports[0].Port))
		}
		return Verbs, fmt.Sprintf("%s, each with an active %s port that libibverbs opens (%s)", reason, ll, strings.Join(ports, ", ")), nil
	}
	return k, reason, err
}

// commonLinkLayer is the link layer on which every member has a usable
// port (Ethernet first), or "" and why not.
func commonLinkLayer(members []MemberInfo, rdma []RDMAOffer) (string, string) {
	for _, ll := range []string{"Ethernet", "InfiniBand"} {
		all := true
		for _, o := range rdma {
			all = all && slices.ContainsFunc(o.Ports, func(p RDMAPortOffer) bool { return p.LinkLayer == ll })
		}
		if all {
			for i := range rdma {
				rdma[i].Ports = slices.DeleteFunc(slices.Clone(rdma[i].Ports), func(p RDMAPortOffer) bool { return p.LinkLayer != ll })
			}
			return ll, ""
		}
	}
	var why []string
	var layers []string
	for i, o := range rdma {
		who := fmt.Sprintf("rank %d on %s", members[i].Rank, members[i].Host)
		switch {
		case !o.Probed:
			why = append(why, who+": libibverbs was not consulted")
		case len(o.Ports) == 0 && o.Why != "":
			why = append(why, fmt.Sprintf("%s has no active RDMA port that libibverbs opens (%s)", who, o.Why))
		case len(o.Ports) == 0:
			why = append(why, who+" has no active RDMA port that libibverbs opens")
		default:
			var ll []string
			for _, p := range o.Ports {
				if !slices.Contains(ll, p.LinkLayer) {
					ll = append(ll, p.LinkLayer)
				}
			}
			layers = append(layers, who+": "+strings.Join(ll, ", "))
		}
	}
	if len(why) == 0 {
		why = append(why, "the leaders' ports are on different link layers ("+strings.Join(layers, "; ")+")")
	}
	return "", strings.Join(why, "; ")
}

func choose(requested Kind, members []MemberInfo) (Kind, string, error) {
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
