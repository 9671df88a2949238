package transport

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpubridge/gpubridge/lib/testenv"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef")

func testParams(self int) *hsParams {
	return &hsParams{secret: testSecret, job: jobTag(testSecret), version: 1, self: self, size: 3, streams: 2}
}

// hsSeeds are handshake messages for the fuzz corpus and round-trip tests.
func hsSeeds() map[string][]byte {
	job := jobTag(testSecret)
	var nonce [hsNonce]byte
	for i := range nonce {
		nonce[i] = byte(i)
	}
	hello := hsMsg{Version: 1, Type: hsHello, Job: job, From: 1, To: 0, Stream: 2, Streams: 2, Nonce: nonce}
	ch := hsMsg{Version: 1, Type: hsChallenge, Nonce: nonce}
	ch.MAC = hsMACOf(testSecret, "srv", 1, &hello, &ch.Nonce)
	proof := hsMsg{Version: 1, Type: hsProof, MAC: hsMACOf(testSecret, "cli", 1, &hello, &ch.Nonce)}
	v2 := hello
	v2.Version = 2
	seeds := map[string][]byte{
		"hello":        appendHS(nil, &hello),
		"challenge":    appendHS(nil, &ch),
		"proof":        appendHS(nil, &proof),
		"welcome":      appendHS(nil, &hsMsg{Version: 1, Type: hsWelcome}),
		"reject":       appendHS(nil, &hsMsg{Version: 1, Type: hsReject, Text: "authentication failed"}),
		"hello_v2":     appendHS(nil, &v2),
		"bad_magic":    []byte("GET / HTTP/1.1\r\n\r\n"),
		"truncated":    appendHS(nil, &hello)[:40],
		"long_body":    append([]byte("GBHS\x01\x00\xff\xff"), make([]byte, 64)...),
		"short_body":   []byte("GBHS\x01\x00\x02\x00\x01\x00"),
		"unknown_type": appendHS(nil, &hsMsg{Version: 1, Type: 9}),
		"reject_ctrl":  appendHS(nil, &hsMsg{Version: 1, Type: hsReject, Text: "bad\x00\x1b[31m\xff"}),
		// a hello followed by a valid proof: a whole client session
		"session": append(appendHS(nil, &hello), appendHS(nil, &proof)...),
	}
	return seeds
}

func TestHandshakeRoundTrip(t *testing.T) {
	for name, b := range hsSeeds() {
		m, err := decodeHS(b)
		if err != nil {
			continue
		}
		t.Run(name, func(t *testing.T) {
			if m.Type == hsReject {
				return
			}
			assert.Equal(t, b, appendHS(nil, &m))
		})
	}
	_, err := decodeHS(hsSeeds()["bad_magic"])
	assert.ErrorIs(t, err, errHandshakeFormat)
	m, err := decodeHS(hsSeeds()["reject_ctrl"])
	require.NoError(t, err)
	assert.Equal(t, "bad??[31m?", m.Text, "control characters and invalid UTF-8 are masked")
}

func TestHandshake(t *testing.T) {
	type result struct {
		from, stream int
		err          error
	}
	run := func(client, server *hsParams, to, stream int, claim func(int, int) error) (result, error) {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		_ = a.SetDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
		_ = b.SetDeadline(time.Now().Add(testenv.Scale(10 * time.Second)))
		var r result
		var wg sync.WaitGroup
		wg.Go(func() {
			r.from, r.stream, r.err = serverHandshake(b, server, serverHooks{claim: claim})
			_ = b.Close()
		})
		cerr := clientHandshake(a, client, to, stream)
		_ = a.Close()
		wg.Wait()
		return r, cerr
	}
	ok := func(int, int) error { return nil }

	t.Run("ok", func(t *testing.T) {
		r, cerr := run(testParams(2), testParams(0), 0, 1, ok)
		require.NoError(t, cerr)
		require.NoError(t, r.err)
		assert.Equal(t, 2, r.from)
		assert.Equal(t, 1, r.stream)
	})
	t.Run("wrong secret client", func(t *testing.T) {
		c := testParams(1)
		c.secret = []byte("guess")
		r, cerr := run(c, testParams(0), 0, 0, ok)
		var ae *authError
		require.ErrorAs(t, cerr, &ae, "the client does not trust a server that cannot prove the secret either")
		require.Error(t, r.err)
	})
	t.Run("wrong secret server", func(t *testing.T) {
		srv := testParams(0)
		srv.secret = []byte("guess")
		r, cerr := run(testParams(1), srv, 0, 0, ok)
		var ae *authError
		require.ErrorAs(t, cerr, &ae)
		assert.Contains(t, cerr.Error(), "member 0's endpoint failed authentication")
		require.Error(t, r.err)
	})
	t.Run("other job", func(t *testing.T) {
		c := testParams(1)
		c.job[0] ^= 1
		r, cerr := run(c, testParams(0), 0, 0, ok)
		assert.ErrorContains(t, cerr, "member 0 refused the connection: wrong job")
		var ae *authError
		require.ErrorAs(t, r.err, &ae)
	})
	t.Run("not my member", func(t *testing.T) {
		r, cerr := run(testParams(2), testParams(1), 0, 0, ok)
		assert.ErrorContains(t, cerr, "refused the connection: this is member 1, not 0")
		assert.Error(t, r.err)
	})
	t.Run("wrong direction", func(t *testing.T) {
		r, cerr := run(testParams(0), testParams(1), 1, 0, ok)
		assert.ErrorContains(t, cerr, "member 0 does not dial member 1")
		assert.Error(t, r.err)
	})
	t.Run("bad stream", func(t *testing.T) {
		r, cerr := run(testParams(1), testParams(0), 0, 3, ok)
		assert.ErrorContains(t, cerr, "stream 3 of 2")
		assert.Error(t, r.err)
	})
	t.Run("claim refused", func(t *testing.T) {
		r, cerr := run(testParams(1), testParams(0), 0, 0, func(int, int) error { return errors.New("duplicate") })
		assert.ErrorContains(t, cerr, "member 0 refused the connection: duplicate")
		assert.Error(t, r.err)
	})
}

// A silent peer cannot hold a handshake past its deadline, and one that
// sends an endless body cannot make the decoder read more than its limit.
func TestHandshakeLimits(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	_ = b.SetDeadline(time.Now().Add(100 * time.Millisecond))
	start := time.Now()
	_, _, err := serverHandshake(b, testParams(0), serverHooks{})
	require.Error(t, err)
	assert.Less(t, time.Since(start), testenv.Scale(5*time.Second))

	r := &countingReader{r: io.MultiReader(bytes.NewReader([]byte("GBHS\x01\x00\x00\x04")), zeroReader{})}
	_, err = readHS(r)
	require.ErrorIs(t, err, errHandshakeFormat, "type 0 is unknown")
	assert.LessOrEqual(t, r.n, hsPreamble+hsMaxBody)
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// FuzzHandshake feeds arbitrary bytes to the handshake decoder and to a
// server handshake as the client's side of the conversation. Nothing may
// panic, read past the limits, or accept a client that did not prove the
// secret; what decodes re-encodes to the same bytes.
func FuzzHandshake(f *testing.F) {
	for _, b := range hsSeeds() {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if m, err := decodeHS(data); err == nil {
			if m.Type < hsHello || m.Type > hsReject {
				t.Fatalf("decoded unknown type %d", m.Type)
			}
			if len(m.Text) > 4*hsMaxText {
				t.Fatalf("reject text of %d bytes", len(m.Text))
			}
			if m.Type != hsReject && len(data) == hsPreamble+hsBodySize[m.Type] && bytes.Equal(data[hsPreamble+1:hsPreamble+4], []byte{0, 0, 0}) {
				if re := appendHS(nil, &m); !bytes.Equal(re, data) {
					t.Fatalf("re-encoded %x, input %x", re, data)
				}
			}
		}
		cr := &countingReader{r: bytes.NewReader(data)}
		_, _, err := serverHandshake(struct {
			io.Reader
			io.Writer
		}{cr, io.Discard}, testParams(0), serverHooks{})
		if err == nil {
			// The server's nonce is random: no fixed input can hold a valid proof.
			t.Fatalf("server accepted %x", data)
		}
		if cr.n > 2*(hsPreamble+hsMaxBody) {
			t.Fatalf("read %d bytes", cr.n)
		}
	})
}

// fuzzCorpusDir holds FuzzHandshake's checked-in seed corpus: hsSeeds as
// seed_<name> files. Other files there are inputs the fuzzer found; they
// are kept.
const fuzzCorpusDir = "testdata/fuzz/FuzzHandshake"

// writeCorpusVar rewrites the seed corpus from hsSeeds:
//
//	GPUBRIDGE_WRITE_FUZZ_CORPUS=1 go test -run TestFuzzSeedCorpus ./lib/transport/
const writeCorpusVar = "GPUBRIDGE_WRITE_FUZZ_CORPUS"

func corpusFile(data []byte) []byte {
	return []byte("go test fuzz v1\n[]byte(" + strconv.Quote(string(data)) + ")\n")
}

// TestFuzzSeedCorpus fails when the checked-in seed corpus differs from
// what hsSeeds would write: a seed missing, out of date, or left over from
// a seed that no longer exists. With GPUBRIDGE_WRITE_FUZZ_CORPUS=1 it
// rewrites the corpus instead.
func TestFuzzSeedCorpus(t *testing.T) {
	write := os.Getenv(writeCorpusVar) == "1"
	if write {
		require.NoError(t, os.MkdirAll(fuzzCorpusDir, 0o755))
	}
	fix := fmt.Sprintf("seed corpus out of date: run %s=1 go test -run TestFuzzSeedCorpus ./lib/transport/", writeCorpusVar)
	seeds := hsSeeds()
	for name, b := range seeds {
		path := filepath.Join(fuzzCorpusDir, "seed_"+name)
		want := corpusFile(b)
		if write {
			require.NoError(t, os.WriteFile(path, want, 0o644))
			continue
		}
		got, err := os.ReadFile(path)
		require.NoError(t, err, fix)
		assert.Equal(t, string(want), string(got), "seed %s: %s", name, fix)
	}
	entries, err := os.ReadDir(fuzzCorpusDir)
	require.NoError(t, err)
	for _, e := range entries {
		path := filepath.Join(fuzzCorpusDir, e.Name())
		if name, ok := strings.CutPrefix(e.Name(), "seed_"); ok {
			if _, ok := seeds[name]; !ok {
				if write {
					require.NoError(t, os.Remove(path))
					continue
				}
				t.Errorf("%s is no seed of hsSeeds any more: %s", path, fix)
			}
		}
		b, err := os.ReadFile(path)
		require.NoError(t, err)
		assert.True(t, strings.HasPrefix(string(b), "go test fuzz v1\n"), "%s is not a corpus file", path)
	}
}
