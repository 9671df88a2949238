package transport

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/gpubridge/gpubridge/lib/rendezvous"
)

// The connection handshake of the TCP transport. Every message is a
// preamble followed by a body:
//
//	preamble: magic "GBHS" | version u16 | body length u16 (4..hsMaxBody)
//	body:     type u8 | 3 zero bytes | fields of the type
//
// The preamble, the type byte and the leading fields of each type are the
// same in every protocol version, so that peers of different versions can
// still tell each other which version they speak. Later versions may append
// fields; a body longer than this version's is accepted and the extra bytes
// ignored. The messages, client (the member with the larger index) first:
//
//	hello     job tag [16] | from u32 | to u32 | stream u32 | streams u32 | client nonce [32]
//	challenge server nonce [32] | HMAC(secret, "srv" | transcript) [32]
//	proof     HMAC(secret, "cli" | transcript) [32]
//	welcome   (nothing): the server took the connection
//	reject    a reason in UTF-8 text (at most hsMaxText bytes); sent instead
//	          of a challenge or a welcome, then the server closes
//
// transcript = version u16 | job tag | from | to | stream | streams |
// client nonce | server nonce. Each side proves that it holds the per-job
// secret over a nonce the other side chose, with distinct labels for the
// two directions, so neither a stranger nor a replay of an earlier session
// gets a connection accepted.
const (
	hsMagic    = "GBHS"
	hsPreamble = 8
	hsMaxBody  = 1024
	hsMaxText  = 512
	hsNonce    = 32
	hsMAC      = sha256.Size
)

// Handshake message types.
const (
	hsHello     = 1
	hsChallenge = 2
	hsProof     = 3
	hsWelcome   = 4
	hsReject    = 5
)

// Body sizes of this version (the least a body of each type must hold).
var hsBodySize = [...]int{
	hsHello:     4 + jobTagSize + 16 + hsNonce,
	hsChallenge: 4 + hsNonce + hsMAC,
	hsProof:     4 + hsMAC,
	hsWelcome:   4,
	hsReject:    4,
}

// hsMsg is one decoded handshake message; which fields are set depends on
// Type.
type hsMsg struct {
	Version uint16
	Type    uint8
	Job     [jobTagSize]byte
	From    uint32
	To      uint32
	Stream  uint32
	Streams uint32
	Nonce   [hsNonce]byte
	MAC     [hsMAC]byte
	Text    string
}

// errHandshakeFormat marks a message that is not a valid handshake message:
// not a gpubridge peer, or a broken one.
var errHandshakeFormat = errors.New("not a gpubridge bridge handshake")

func hsTypeName(t uint8) string {
	switch t {
	case hsHello:
		return "hello"
	case hsChallenge:
		return "challenge"
	case hsProof:
		return "proof"
	case hsWelcome:
		return "welcome"
	case hsReject:
		return "reject"
	}
	return fmt.Sprintf("type %d", t)
}

// appendHS encodes m.
func appendHS(b []byte, m *hsMsg) []byte {
	var body []byte
	body = append(body, m.Type, 0, 0, 0)
	switch m.Type {
	case hsHello:
		body = append(body, m.Job[:]...)
		body = binary.LittleEndian.AppendUint32(body, m.From)
		body = binary.LittleEndian.AppendUint32(body, m.To)
		body = binary.LittleEndian.AppendUint32(body, m.Stream)
		body = binary.LittleEndian.AppendUint32(body, m.Streams)
		body = append(body, m.Nonce[:]...)
	case hsChallenge:
		body = append(body, m.Nonce[:]...)
		body = append(body, m.MAC[:]...)
	case hsProof:
		body = append(body, m.MAC[:]...)
	case hsReject:
		t := m.Text
		if len(t) > hsMaxText {
			t = strings.ToValidUTF8(t[:hsMaxText], "")
		}
		body = append(body, t...)
	}
	b = append(b, hsMagic...)
	b = binary.LittleEndian.AppendUint16(b, m.Version)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(body)))
	return append(b, body...)
}

// readHS reads and decodes one handshake message from r, reading at most
// hsPreamble+hsMaxBody bytes. It checks the framing and the type's layout,
// not the version: the caller compares that.
func readHS(r io.Reader) (hsMsg, error) {
	var buf [hsPreamble + hsMaxBody]byte
	if _, err := io.ReadFull(r, buf[:hsPreamble]); err != nil {
		return hsMsg{}, err
	}
	n, err := parsePreamble(buf[:hsPreamble])
	if err != nil {
		return hsMsg{}, err
	}
	if _, err := io.ReadFull(r, buf[hsPreamble:hsPreamble+n]); err != nil {
		return hsMsg{}, err
	}
	return decodeHS(buf[:hsPreamble+n])
}

// parsePreamble checks the magic and returns the body length.
func parsePreamble(p []byte) (int, error) {
	if string(p[:4]) != hsMagic {
		return 0, fmt.Errorf("%w: bad magic %q", errHandshakeFormat, p[:4])
	}
	n := int(binary.LittleEndian.Uint16(p[6:]))
	if n < 4 || n > hsMaxBody {
		return 0, fmt.Errorf("%w: body of %d bytes (4..%d allowed)", errHandshakeFormat, n, hsMaxBody)
	}
	return n, nil
}

// decodeHS decodes one whole message (preamble and body).
func decodeHS(p []byte) (hsMsg, error) {
	if len(p) < hsPreamble {
		return hsMsg{}, fmt.Errorf("%w: %d bytes", errHandshakeFormat, len(p))
	}
	n, err := parsePreamble(p)
	if err != nil {
		return hsMsg{}, err
	}
	if len(p) != hsPreamble+n {
		return hsMsg{}, fmt.Errorf("%w: body of %d bytes, preamble says %d", errHandshakeFormat, len(p)-hsPreamble, n)
	}
	m := hsMsg{Version: binary.LittleEndian.Uint16(p[4:])}
	body := p[hsPreamble:]
	m.Type = body[0]
	if m.Type < hsHello || int(m.Type) >= len(hsBodySize) {
		return hsMsg{}, fmt.Errorf("%w: unknown message type %d", errHandshakeFormat, m.Type)
	}
	if len(body) < hsBodySize[m.Type] {
		return hsMsg{}, fmt.Errorf("%w: %s of %d bytes, need %d", errHandshakeFormat, hsTypeName(m.Type), len(body), hsBodySize[m.Type])
	}
	f := body[4:]
	switch m.Type {
	case hsHello:
		copy(m.Job[:], f)
		f = f[jobTagSize:]
		m.From = binary.LittleEndian.Uint32(f[0:])
		m.To = binary.LittleEndian.Uint32(f[4:])
		m.Stream = binary.LittleEndian.Uint32(f[8:])
		m.Streams = binary.LittleEndian.Uint32(f[12:])
		copy(m.Nonce[:], f[16:])
	case hsChallenge:
		copy(m.Nonce[:], f)
		copy(m.MAC[:], f[hsNonce:])
	case hsProof:
		copy(m.MAC[:], f)
	case hsReject:
		m.Text = rendezvous.PeerText(f, hsMaxText)
	}
	return m, nil
}

// hsMACOf computes the proof of one direction ("srv" or "cli") over the
// transcript of hello and the server nonce.
func hsMACOf(secret []byte, label string, version uint16, hello *hsMsg, serverNonce *[hsNonce]byte) [hsMAC]byte {
	h := hmac.New(sha256.New, secret)
	var b [2 + jobTagSize + 16]byte
	binary.LittleEndian.PutUint16(b[0:], version)
	copy(b[2:], hello.Job[:])
	binary.LittleEndian.PutUint32(b[2+jobTagSize:], hello.From)
	binary.LittleEndian.PutUint32(b[6+jobTagSize:], hello.To)
	binary.LittleEndian.PutUint32(b[10+jobTagSize:], hello.Stream)
	binary.LittleEndian.PutUint32(b[14+jobTagSize:], hello.Streams)
	h.Write([]byte(label))
	h.Write(b[:])
	h.Write(hello.Nonce[:])
	h.Write(serverNonce[:])
	var out [hsMAC]byte
	h.Sum(out[:0])
	return out
}

// hsParams is what one member knows for handshakes.
type hsParams struct {
	secret  []byte
	job     [jobTagSize]byte
	version uint16
	self    int
	size    int
	streams int
}

// versionError is a protocol version mismatch between two members.
type versionError struct {
	member       int
	theirs, ours uint16
}

func (e *versionError) Error() string {
	return fmt.Sprintf("member %d speaks bridge protocol v%d, this gbbridge speaks v%d", e.member, e.theirs, e.ours)
}

// authError is a peer that failed to prove it holds the job's secret.
type authError struct{ msg string }

func (e *authError) Error() string { return e.msg }

// rejectError is a refusal sent by the server.
type rejectError struct {
	member int
	reason string
}

func (e *rejectError) Error() string {
	return fmt.Sprintf("member %d refused the connection: %s", e.member, e.reason)
}

// unansweredError is a connection that failed before the listener took
// it (answered the hello, then welcomed the proof): closed, reset or
// silent. The listener may have shed it to make room (strangers hold its
// pending handshakes), so the dialer tries again. (A connection the
// listener did take, whose welcome the dialer still missed, is refused on
// the next try as a duplicate: a clear error, not a hang.)
type unansweredError struct {
	op  string
	err error
}

func (e *unansweredError) Error() string { return e.op + ": " + e.err.Error() }
func (e *unansweredError) Unwrap() error { return e.err }

func writeHS(w io.Writer, m *hsMsg) error {
	_, err := w.Write(appendHS(make([]byte, 0, hsPreamble+hsMaxBody), m))
	return err
}

// clientHandshake runs the dialing side's handshake for stream of member to
// on rw, which must have a deadline set.
func clientHandshake(rw io.ReadWriter, p *hsParams, to, stream int) error {
	hello := hsMsg{Version: p.version, Type: hsHello, Job: p.job, From: uint32(p.self), To: uint32(to),
		Stream: uint32(stream), Streams: uint32(p.streams)}
	if _, err := rand.Read(hello.Nonce[:]); err != nil {
		return err
	}
	if err := writeHS(rw, &hello); err != nil {
		return &unansweredError{op: "send hello", err: err}
	}
	m, err := readHS(rw)
	if err != nil {
		if errors.Is(err, errHandshakeFormat) {
			return fmt.Errorf("read challenge: %w", err)
		}
		return &unansweredError{op: "read challenge", err: err}
	}
	if m.Version != p.version {
		return &versionError{member: to, theirs: m.Version, ours: p.version}
	}
	switch m.Type {
	case hsReject:
		return &rejectError{member: to, reason: m.Text}
	case hsChallenge:
	default:
		return fmt.Errorf("%w: got %s, want challenge", errHandshakeFormat, hsTypeName(m.Type))
	}
	want := hsMACOf(p.secret, "srv", p.version, &hello, &m.Nonce)
	if !hmac.Equal(want[:], m.MAC[:]) {
		return &authError{fmt.Sprintf("the listener at member %d's endpoint failed authentication (not a member of this job, or another job's secret)", to)}
	}
	proof := hsMsg{Version: p.version, Type: hsProof, MAC: hsMACOf(p.secret, "cli", p.version, &hello, &m.Nonce)}
	if err := writeHS(rw, &proof); err != nil {
		return &unansweredError{op: "send proof", err: err}
	}
	m, err = readHS(rw)
	if err != nil {
		if errors.Is(err, errHandshakeFormat) {
			return fmt.Errorf("read welcome: %w", err)
		}
		return &unansweredError{op: "read welcome", err: err}
	}
	switch {
	case m.Type == hsReject:
		return &rejectError{member: to, reason: m.Text}
	case m.Type != hsWelcome:
		return fmt.Errorf("%w: got %s, want welcome", errHandshakeFormat, hsTypeName(m.Type))
	}
	return nil
}

// serverHooks are what the listening side's handshake reports as it goes.
type serverHooks struct {
	// tagged is called once the hello carries this job's tag, before its
	// version and addressing are checked: the connection speaks for this
	// job (the tag is not secret, so it is not yet authenticated). Nil: no
	// call.
	tagged func()
	// claim is called once the client is authenticated; when it fails the
	// connection is refused with its error.
	claim func(from, stream int) error
}

// serverHandshake runs the listening side's handshake on rw, which must
// have a deadline set. It returns the client's member and stream index.
// The job tag is checked before anything else in the hello, so that a
// stranger's hello (another version, another job, garbage) is told apart
// from a member's.
func serverHandshake(rw io.ReadWriter, p *hsParams, hooks serverHooks) (from, stream int, err error) {
	reject := func(reason string) {
		_ = writeHS(rw, &hsMsg{Version: p.version, Type: hsReject, Text: reason})
	}
	hello, err := readHS(rw)
	if err != nil {
		return 0, 0, fmt.Errorf("read hello: %w", err)
	}
	if hello.Type != hsHello {
		return 0, 0, fmt.Errorf("%w: got %s, want hello", errHandshakeFormat, hsTypeName(hello.Type))
	}
	if hello.Job != p.job {
		reject("wrong job: this is a bridge member of another job")
		return 0, 0, &authError{"hello for another job (a stale member of an earlier job, or a stranger)"}
	}
	if hooks.tagged != nil {
		hooks.tagged()
	}
	if hello.Version != p.version {
		reject(fmt.Sprintf("this gbbridge speaks bridge protocol v%d", p.version))
		return 0, 0, &versionError{member: int(hello.From), theirs: hello.Version, ours: p.version}
	}
	to := int(hello.To)
	from, stream = int(hello.From), int(hello.Stream)
	switch {
	case to != p.self:
		reject(fmt.Sprintf("this is member %d, not %d", p.self, to))
		return 0, 0, fmt.Errorf("hello addressed to member %d, this is member %d", to, p.self)
	case from <= p.self || from >= p.size:
		reject(fmt.Sprintf("member %d does not dial member %d", from, p.self))
		return 0, 0, fmt.Errorf("hello from member %d, which does not dial member %d (bridge of %d members)", from, p.self, p.size)
	case int(hello.Streams) != p.streams || stream > p.streams:
		reject(fmt.Sprintf("stream %d of %d, this member has %d streams per peer", stream, hello.Streams, p.streams))
		return 0, 0, fmt.Errorf("hello from member %d for stream %d of %d, this member has %d streams per peer", from, stream, hello.Streams, p.streams)
	}
	ch := hsMsg{Version: p.version, Type: hsChallenge}
	if _, err := rand.Read(ch.Nonce[:]); err != nil {
		return 0, 0, err
	}
	ch.MAC = hsMACOf(p.secret, "srv", p.version, &hello, &ch.Nonce)
	if err := writeHS(rw, &ch); err != nil {
		return 0, 0, fmt.Errorf("send challenge: %w", err)
	}
	proof, err := readHS(rw)
	if err != nil {
		return 0, 0, fmt.Errorf("read proof: %w", err)
	}
	if proof.Type != hsProof || proof.Version != p.version {
		return 0, 0, fmt.Errorf("%w: got %s v%d, want proof", errHandshakeFormat, hsTypeName(proof.Type), proof.Version)
	}
	want := hsMACOf(p.secret, "cli", p.version, &hello, &ch.Nonce)
	if !hmac.Equal(want[:], proof.MAC[:]) {
		reject("authentication failed")
		return 0, 0, &authError{fmt.Sprintf("a client claiming to be member %d failed authentication (bad HMAC: not a member of this job)", from)}
	}
	if hooks.claim != nil {
		if err := hooks.claim(from, stream); err != nil {
			reject(err.Error())
			return 0, 0, err
		}
	}
	if err := writeHS(rw, &hsMsg{Version: p.version, Type: hsWelcome}); err != nil {
		return 0, 0, fmt.Errorf("send welcome: %w", err)
	}
	return from, stream, nil
}
