package store

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpubridge/gpubridge/lib/testenv"
)

// Limits used by the fuzz target: small, so that the fuzzer reaches them.
var fuzzLimits = ServerOptions{MaxKeyLen: 64, MaxValueLen: 128, MaxKeysPerRequest: 16, MaxTotalBytes: 1 << 10, MaxReplyBytes: 300}

// FuzzServerDecode feeds arbitrary bytes (after the handshake) to the
// server's request decoder and executes what it decodes against a server
// state. It checks that nothing panics, that decoded requests respect the
// limits and re-encode to exactly the bytes consumed, and that the memory
// budget matches what the store holds.
func FuzzServerDecode(f *testing.F) {
	for _, s := range fuzzSeeds() {
		f.Add(s.data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		hang := time.AfterFunc(testenv.Scale(60*time.Second), func() { panic(fmt.Sprintf("FuzzServerDecode hangs on %x", data)) })
		defer hang.Stop()
		s := NewServer(fuzzLimits)
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		sc := newServerConn(a, &s.out)

		dec := newDecoder(bufio.NewReaderSize(bytes.NewReader(data), 16), s.lim, &s.mem)
		var re enc
		for {
			req, err := dec.next()
			if err != nil {
				var pe *protocolError
				if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) &&
					!errors.As(err, &pe) && !errors.Is(err, errOverBudget) {
					t.Fatalf("unexpected decode error %T %v", err, err)
				}
				break
			}
			checkRequest(t, req)
			encodeRequest(&re, req)
			if !bytes.HasPrefix(data, re.b) {
				t.Fatalf("re-encoded %s does not match the input:\n in: %x\nout: %x", cmdName(req.cmd), data, re.b)
			}
			err = s.handle(sc, req)
			// Discard replies: no writer runs here.
			sc.out.drop()
			if n := s.out.inUse(); n != 0 {
				t.Fatalf("output budget holds %d bytes after the replies were dropped", n)
			}
			if err != nil {
				var pe *protocolError
				if !errors.As(err, &pe) && !errors.Is(err, errOverBudget) {
					t.Fatalf("unexpected handle error %T %v", err, err)
				}
				break
			}
			checkBudget(t, s, sc)
		}
		s.st.mu.Lock()
		s.st.dropWaits(sc)
		s.st.mu.Unlock()
		checkBudget(t, s, sc)
	})
}

func checkRequest(t *testing.T, r *request) {
	if len(r.keys) > fuzzLimits.MaxKeysPerRequest {
		t.Fatalf("%d keys", len(r.keys))
	}
	for _, k := range r.keys {
		if len(k) > fuzzLimits.MaxKeyLen {
			t.Fatalf("key of %d bytes", len(k))
		}
	}
	for _, v := range r.values {
		if len(v) > fuzzLimits.MaxValueLen {
			t.Fatalf("value of %d bytes", len(v))
		}
	}
	wantKeys, wantValues := -1, -1
	switch r.cmd {
	case cmdSet, cmdAppend, cmdQueuePush:
		wantKeys, wantValues = 1, 1
	case cmdCompareSet:
		wantKeys, wantValues = 1, 2
	case cmdGet, cmdAdd, cmdDeleteKey, cmdQueuePop, cmdQueueLen:
		wantKeys, wantValues = 1, 0
	case cmdValidate, cmdPing, cmdGetNumKeys, cmdCancelWait, cmdListKeys:
		wantKeys, wantValues = 0, 0
	case cmdCheck, cmdWait, cmdMultiGet:
		wantValues = 0
	case cmdMultiSet:
		wantValues = len(r.keys)
	default:
		t.Fatalf("decoded unknown command %d", r.cmd)
	}
	if wantKeys >= 0 && len(r.keys) != wantKeys || len(r.values) != wantValues {
		t.Fatalf("%s with %d keys, %d values", cmdName(r.cmd), len(r.keys), len(r.values))
	}
}

// checkBudget compares the budget with the memory the state accounts for.
func checkBudget(t *testing.T, s *Server, sc *serverConn) {
	st := &s.st
	st.mu.Lock()
	defer st.mu.Unlock()
	var want int64
	for k, v := range st.kv {
		want += entryCost(k, v)
	}
	for k, q := range st.queues {
		if len(q.items) == q.head {
			t.Fatalf("empty queue %q kept", k)
		}
		want += int64(len(k)) + entryOverhead
		for _, v := range q.items[q.head:] {
			want += int64(cap(v)) + entryOverhead
		}
	}
	for _, w := range sc.waits {
		want += w.cost
		if w.done || w.remaining <= 0 {
			t.Fatalf("finished waiter still registered")
		}
	}
	if got := s.mem.used.Load(); got != want {
		t.Fatalf("budget says %d bytes used, state holds %d", got, want)
	}
	if s.mem.used.Load() > s.mem.max {
		t.Fatalf("budget exceeded")
	}
}

type fuzzSeed struct {
	name string
	data []byte
}

// fuzzSeeds are the checked-in seed corpus: every command, pipelines,
// truncated and oversized requests.
func fuzzSeeds() []fuzzSeed {
	req := func(rs ...*request) []byte {
		var e enc
		for _, r := range rs {
			encodeRequest(&e, r)
		}
		return e.b
	}
	k := func(s ...string) []string { return s }
	v := func(s ...string) [][]byte {
		out := make([][]byte, len(s))
		for i, x := range s {
			out[i] = []byte(x)
		}
		return out
	}
	set := &request{cmd: cmdSet, keys: k("/a"), values: v("1")}
	seeds := []fuzzSeed{
		{"validate", req(&request{cmd: cmdValidate, nonce: validationMagic})},
		{"ping", req(&request{cmd: cmdPing, nonce: 0x190e})},
		{"set", req(set)},
		{"compare_set", req(set, &request{cmd: cmdCompareSet, keys: k("/a"), values: v("1", "2")})},
		{"compare_set_missing", req(&request{cmd: cmdCompareSet, keys: k("/cs"), values: v("", "y")})},
		{"get", req(set, &request{cmd: cmdGet, keys: k("/a")})},
		{"add", req(&request{cmd: cmdAdd, keys: k("/n"), delta: 3}, &request{cmd: cmdAdd, keys: k("/n"), delta: -1 << 63})},
		{"add_non_numeric", req(&request{cmd: cmdSet, keys: k("/t"), values: v("abc")}, &request{cmd: cmdAdd, keys: k("/t"), delta: 1})},
		{"add_to_text_number", req(&request{cmd: cmdSet, keys: k("/t"), values: v(" 12x")}, &request{cmd: cmdAdd, keys: k("/t"), delta: 1})},
		{"check", req(set, &request{cmd: cmdCheck, keys: k("/a", "/b")})},
		{"wait", req(&request{cmd: cmdWait, keys: k("/w1", "/w2")}, &request{cmd: cmdSet, keys: k("/w1"), values: v("")},
			&request{cmd: cmdMultiSet, keys: k("/w2"), values: v("x")})},
		{"wait_cancel", req(&request{cmd: cmdWait, keys: k("/w")}, &request{cmd: cmdCancelWait})},
		{"getnumkeys", req(set, &request{cmd: cmdGetNumKeys})},
		{"delete_key", req(set, &request{cmd: cmdDeleteKey, keys: k("/a")}, &request{cmd: cmdDeleteKey, keys: k("/a")})},
		{"append", req(&request{cmd: cmdAppend, keys: k("/ap"), values: v("a")}, &request{cmd: cmdAppend, keys: k("/ap"), values: v("bc")})},
		{"multi_get", req(set, &request{cmd: cmdMultiGet, keys: k("/a", "/missing")})},
		{"multi_set", req(&request{cmd: cmdMultiSet, keys: k("/m1", "/m2"), values: v("1", "2")})},
		{"cancel_wait", req(&request{cmd: cmdCancelWait})},
		{"queue", req(&request{cmd: cmdWait, keys: k("/q")}, &request{cmd: cmdQueuePush, keys: k("/q"), values: v("item")},
			&request{cmd: cmdQueueLen, keys: k("/q")}, &request{cmd: cmdQueuePop, keys: k("/q")}, &request{cmd: cmdQueuePop, keys: k("/q")})},
		{"list_keys", req(set, &request{cmd: cmdListKeys})},
		{"torch_client_session", req(&request{cmd: cmdValidate, nonce: validationMagic}, &request{cmd: cmdPing, nonce: 7},
			&request{cmd: cmdAdd, keys: k("init/"), delta: 1},
			&request{cmd: cmdSet, keys: k("/default_pg/0//cpu//rank_0"), values: v("addr")},
			&request{cmd: cmdWait, keys: k("/default_pg/0//cpu//rank_0")},
			&request{cmd: cmdGet, keys: k("/default_pg/0//cpu//rank_0")})},
		// Truncated requests.
		{"truncated_set_key", req(set)[:5]},
		{"truncated_set_value", req(set)[:12]},
		{"truncated_ping", []byte{cmdPing, 1, 2}},
		{"truncated_multi_set", req(&request{cmd: cmdMultiSet, keys: k("/m1", "/m2"), values: v("1", "2")})[:30]},
		// Oversized and malformed requests.
		{"oversized_key", append(append([]byte{cmdGet}, le64(65)...), bytes.Repeat([]byte("k"), 65)...)},
		{"oversized_value", append(append([]byte{cmdSet}, append(le64(1), 'k')...), le64(129)...)},
		{"huge_value_len", append(append([]byte{cmdQueuePush}, append(le64(1), 'k')...), le64(^uint64(0))...)},
		{"too_many_keys", append([]byte{cmdMultiGet}, le64(17)...)},
		{"unknown_command", []byte{18, 0, 0}},
		{"bad_magic", []byte{cmdValidate, 0xce, 0xf7, 0x85, 0x3d}},
		{"reply_over_limit", req(&request{cmd: cmdSet, keys: k("/v"), values: [][]byte{bytes.Repeat([]byte("v"), 120)}},
			&request{cmd: cmdMultiGet, keys: k("/v", "/v", "/v")})},
		{"over_budget", func() []byte {
			var rs []*request
			for i := range 6 {
				rs = append(rs, &request{cmd: cmdSet, keys: k(fmt.Sprint("/big", i)), values: [][]byte{bytes.Repeat([]byte("v"), 120)}})
			}
			return req(rs...)
		}()},
	}
	return seeds
}

const corpusDir = "testdata/fuzz/FuzzServerDecode"

func corpusFile(data []byte) []byte {
	return fmt.Appendf(nil, "go test fuzz v1\n[]byte(%q)\n", data)
}

// TestFuzzSeedCorpus checks that the checked-in seed corpus matches
// fuzzSeeds; GPUBRIDGE_WRITE_FUZZ_CORPUS=1 rewrites it.
func TestFuzzSeedCorpus(t *testing.T) {
	write := os.Getenv("GPUBRIDGE_WRITE_FUZZ_CORPUS") == "1"
	if write {
		require.NoError(t, os.MkdirAll(corpusDir, 0o755))
	}
	for _, s := range fuzzSeeds() {
		path := filepath.Join(corpusDir, "seed_"+s.name)
		want := corpusFile(s.data)
		if write {
			require.NoError(t, os.WriteFile(path, want, 0o644))
			continue
		}
		got, err := os.ReadFile(path)
		require.NoError(t, err, "seed corpus out of date: run GPUBRIDGE_WRITE_FUZZ_CORPUS=1 go test -run TestFuzzSeedCorpus ./lib/store/")
		assert.Equal(t, string(want), string(got), "seed %s out of date", s.name)
	}
	entries, err := os.ReadDir(corpusDir)
	require.NoError(t, err)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(corpusDir, e.Name()))
		require.NoError(t, err)
		assert.True(t, strings.HasPrefix(string(b), "go test fuzz v1\n"), e.Name())
	}
}
