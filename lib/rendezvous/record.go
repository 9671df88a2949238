package rendezvous

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
)

// Identity is who wrote a record. Every record embeds it, so that a
// record published under another member's key, or by a member with
// another view of the topology, is refused.
type Identity struct {
	Member   int    `json:"member"`
	Rank     int    `json:"rank"`
	Hostname string `json:"hostname"`
	PID      int    `json:"pid"`
}

func (id Identity) identity() Identity { return id }

// Record is what a member publishes: a struct that embeds Identity and
// encodes to a JSON object (a transport's endpoint: where and how to
// reach the member).
type Record interface{ identity() Identity }

// Identity is this member's Identity, for its record.
func (s *Session) Identity() Identity {
	me := s.cfg.Members[s.cfg.Self]
	return Identity{Member: s.cfg.Self, Rank: me.Rank, Hostname: me.Host, PID: os.Getpid()}
}

// maxRecordBytes bounds a record read from the store (an endpoint record
// has about 400 bytes).
const maxRecordBytes = 4 << 10

// The signature is the record's last JSON member: {...,"mac":"<hex>"},
// HMAC-SHA256(secret, "endpoint" 0x00 | the record without it).
const (
	macLabel = "endpoint\x00"
	macOpen  = `,"mac":"`
	macTail  = len(macOpen) + 2*sha256.Size + len(`"}`)
)

// Publish signs rec and writes it as this member's record.
func (s *Session) Publish(ctx context.Context, rec Record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if len(b) < 3 || b[0] != '{' || b[len(b)-1] != '}' {
		return fmt.Errorf("a record must be a non-empty JSON object, not %s", b)
	}
	if err := s.cfg.Store.Set(ctx, s.key(keyRecord+strconv.Itoa(s.cfg.Self)), s.sign(b)); err != nil {
		return s.Explain(ctx, err, "publish the endpoint")
	}
	return nil
}

func (s *Session) mac(body []byte) []byte {
	h := hmac.New(sha256.New, s.secret)
	h.Write([]byte(macLabel))
	h.Write(body)
	return h.Sum(nil)
}

// sign appends the signature member to the JSON object b.
func (s *Session) sign(b []byte) []byte {
	out := make([]byte, 0, len(b)+macTail)
	out = append(out, b[:len(b)-1]...)
	out = append(out, macOpen...)
	out = hex.AppendEncode(out, s.mac(b))
	return append(out, `"}`...)
}

// verify reports whether raw is a record signed with the job's secret.
func (s *Session) verify(raw []byte) bool {
	if len(raw) < macTail+2 {
		return false
	}
	cut := len(raw) - macTail
	tail := raw[cut:]
	if !bytes.HasPrefix(tail, []byte(macOpen)) || !bytes.HasSuffix(tail, []byte(`"}`)) {
		return false
	}
	got, err := hex.DecodeString(string(tail[len(macOpen) : len(tail)-2]))
	if err != nil {
		return false
	}
	body := append(bytes.Clone(raw[:cut]), '}')
	return hmac.Equal(got, s.mac(body))
}

// decode parses a record read from the store; its signature is checked
// apart.
func decode[R Record](b []byte) (R, error) {
	var r R
	if len(b) > maxRecordBytes {
		return r, fmt.Errorf("%d bytes, over the %d-byte limit", len(b), maxRecordBytes)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		var zero R
		if !json.Valid(b) {
			return zero, fmt.Errorf("not JSON: %w", err)
		}
		return zero, fmt.Errorf("JSON, but not an endpoint record: %w", err)
	}
	return r, nil
}

// Gather waits for every member's record and returns them in member order,
// once agree (nil: none) accepted them and each is signed with the job's
// secret and names its writer. Every member reads the same records, so
// agree's error is a *SharedError: the same on every member.
func Gather[R Record](ctx context.Context, s *Session, agree func(recs []R) error) ([]R, error) {
	n := s.Size()
	keys := make([]string, n)
	owners := make([]int, n)
	for i := range keys {
		keys[i] = keyRecord + strconv.Itoa(i)
		owners[i] = i
	}
	vals, err := s.await(ctx, keys, owners, "publish its endpoint")
	if err != nil {
		return nil, err
	}
	recs := make([]R, n)
	for i, v := range vals {
		if recs[i], err = decode[R](v); err != nil {
			return nil, fmt.Errorf("%s published a bad endpoint record: %w", s.Who(i), err)
		}
	}
	if agree != nil {
		if err := agree(recs); err != nil {
			return nil, &SharedError{err}
		}
	}
	for i, v := range vals {
		if !s.verify(v) {
			return nil, &SharedError{fmt.Errorf("the endpoint record of %s is not signed with this job's secret (written by a stranger, or a member of another job)", s.Who(i))}
		}
		id, me := recs[i].identity(), s.cfg.Members[i]
		if id.Member != i || id.Rank != me.Rank || id.Hostname != me.Host {
			return nil, fmt.Errorf("the endpoint record of %s says member %d, rank %d on %s: the members have different topologies", s.Who(i), id.Member, id.Rank, id.Hostname)
		}
	}
	return recs, nil
}
