package transport

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
)

// setup is one member's set-up in progress: its config and its session of
// the rendezvous.
type setup struct {
	cfg   Config
	rv    *rendezvous.Session
	log   *slog.Logger
	proto uint16
	job   [jobTagSize]byte
}

// jobTagSize is the length of a job tag.
const jobTagSize = 16

// jobTag identifies the job in handshakes and ring file names: a one-way
// hash of the secret, so it reveals nothing about it. (The namespace
// itself is not visible through the store; the secret is as unique.)
func jobTag(secret []byte) [jobTagSize]byte {
	h := sha256.New()
	h.Write([]byte("gpubridge job tag\x00"))
	h.Write(secret)
	var t [jobTagSize]byte
	copy(t[:], h.Sum(nil))
	return t
}

// endpoint begins every transport's endpoint record: the settings every
// member must agree on, and who wrote it. A transport's record embeds it
// and adds how to reach the member.
type endpoint struct {
	Proto     int  `json:"proto"`
	Transport Kind `json:"transport"`
	Streams   int  `json:"streams"`
	P2P       int  `json:"p2p_streams,omitempty"`
	CRC       bool `json:"crc"`
	rendezvous.Identity
}

func (e endpoint) settings() endpoint { return e }

// endpointRecord is a transport's endpoint record.
type endpointRecord interface {
	rendezvous.Record
	settings() endpoint
}

// endpoint fills the fields every transport publishes.
func (s *setup) endpoint() endpoint {
	return endpoint{Proto: int(s.proto), Transport: s.cfg.Transport, Streams: s.cfg.Streams, P2P: s.cfg.P2PStreams, CRC: s.cfg.CRC,
		Identity: s.rv.Identity()}
}

// gather reads every member's endpoint record, checked to agree on the
// settings: the same error on every member when they do not.
func gather[R endpointRecord](ctx context.Context, s *setup) ([]R, error) {
	return rendezvous.Gather(ctx, s.rv, func(recs []R) error {
		var diffs []string
		diff := func(what string, val func(e endpoint) string) {
			first := val(recs[0].settings())
			same := true
			for _, r := range recs {
				same = same && val(r.settings()) == first
			}
			if !same {
				parts := make([]string, len(recs))
				for i, r := range recs {
					parts[i] = s.rv.Who(i) + " " + val(r.settings())
				}
				diffs = append(diffs, what+": "+strings.Join(parts, ", "))
			}
		}
		diff("bridge protocol", func(e endpoint) string { return "v" + strconv.Itoa(e.Proto) })
		diff("transport", func(e endpoint) string { return string(e.Transport) })
		diff("streams per peer", func(e endpoint) string { return strconv.Itoa(e.Streams) })
		diff("point-to-point streams per peer", func(e endpoint) string { return strconv.Itoa(e.P2P) })
		diff("crc", func(e endpoint) string { return onOff(e.CRC) })
		if len(diffs) > 0 {
			return fmt.Errorf("members disagree on the bridge settings: %s", strings.Join(diffs, "; "))
		}
		return nil
	})
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}
