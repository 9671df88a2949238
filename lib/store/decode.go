package store

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
)

// request is one decoded client request.
type request struct {
	cmd    byte
	keys   []string // key(s); CHECK/WAIT/MULTI_GET/MULTI_SET: all keys
	values [][]byte // SET/APPEND/QUEUE_PUSH: [value]; COMPARE_SET: [expected, desired]; MULTI_SET: one per key
	delta  int64    // ADD
	nonce  uint32   // PING nonce, VALIDATE magic
	cost   int64    // bytes reserved in the memory budget while decoding
}

// limits bounds what one request may carry.
type limits struct {
	maxKeyLen   int
	maxValueLen int
	maxKeys     int
}

// protocolError marks a request the server refuses; the connection is
// closed with its message as the logged reason.
type protocolError struct{ msg string }

func (e *protocolError) Error() string { return e.msg }

func protoErrorf(format string, args ...any) error {
	return &protocolError{msg: fmt.Sprintf(format, args...)}
}

// errOverBudget is returned when the server's memory budget
// (ServerOptions.MaxTotalBytes) cannot hold a request or a stored value.
var errOverBudget = errors.New("server memory budget (MaxTotalBytes) exhausted")

// entryOverhead approximates the bookkeeping memory of one key, one value or
// one list element; it is charged to the budget together with the bytes.
const entryOverhead = 48

// budget is the server-wide memory account: stored keys, values and queue
// items plus the requests being decoded. Reservations never block; a
// reservation that does not fit fails.
type budget struct {
	max  int64
	used atomic.Int64
}

func (b *budget) reserve(n int64) bool {
	if n <= 0 {
		return true
	}
	if b.used.Add(n) > b.max {
		b.used.Add(-n)
		return false
	}
	return true
}

func (b *budget) release(n int64) {
	if n > 0 {
		b.used.Add(-n)
	}
}

// decoder reads requests from one connection. Every size announced by the
// peer is checked against the limits before anything is read, and memory is
// charged to the budget as the bytes arrive, not as announced: a peer that
// announces an 8 MiB value and sends nothing holds nothing.
type decoder struct {
	r   *bufio.Reader
	lim limits
	mem *budget
	req *request // request being decoded, for releasing its reservation on error
	// begin and end, when set, bracket the decoding of one request after its
	// command byte arrived (the server puts a deadline on it).
	begin, end func()
}

func newDecoder(r *bufio.Reader, lim limits, mem *budget) *decoder {
	return &decoder{r: r, lim: lim, mem: mem}
}

// charge reserves n bytes for the request being decoded.
func (d *decoder) charge(n int64) error {
	if !d.mem.reserve(n) {
		return errOverBudget
	}
	d.req.cost += n
	return nil
}

// next decodes one request. io.EOF means the peer closed the connection
// cleanly between requests; io.ErrUnexpectedEOF a close inside a request; a
// *protocolError or errOverBudget a refused request; a net.Error timeout a
// request not completed within the server's request deadline. On error
// nothing stays reserved.
func (d *decoder) next() (*request, error) {
	cmd, err := d.r.ReadByte()
	if err != nil {
		return nil, err
	}
	if d.begin != nil {
		d.begin()
		defer d.end()
	}
	d.req = &request{cmd: cmd}
	if err := d.body(d.req); err != nil {
		d.mem.release(d.req.cost)
		d.req = nil
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	r := d.req
	d.req = nil
	return r, nil
}

func (d *decoder) body(r *request) error {
	var err error
	switch r.cmd {
	case cmdValidate:
		if r.nonce, err = readU32(d.r); err != nil {
			return err
		}
		if r.nonce != validationMagic {
			return protoErrorf("VALIDATE with bad magic %#08x", r.nonce)
		}
	case cmdPing:
		r.nonce, err = readU32(d.r)
		return err
	case cmdSet, cmdAppend, cmdQueuePush:
		if err = d.key(r); err != nil {
			return err
		}
		return d.value(r)
	case cmdCompareSet:
		if err = d.key(r); err != nil {
			return err
		}
		if err = d.value(r); err != nil {
			return err
		}
		return d.value(r)
	case cmdGet, cmdDeleteKey, cmdQueuePop, cmdQueueLen:
		return d.key(r)
	case cmdAdd:
		if err = d.key(r); err != nil {
			return err
		}
		r.delta, err = readI64(d.r)
		return err
	case cmdCheck, cmdWait, cmdMultiGet, cmdMultiSet:
		n, err := d.count(r.cmd)
		if err != nil {
			return err
		}
		for range n {
			if err = d.key(r); err != nil {
				return err
			}
			if r.cmd == cmdMultiSet {
				if err = d.value(r); err != nil {
					return err
				}
			}
		}
	case cmdGetNumKeys, cmdCancelWait, cmdListKeys:
	default:
		return protoErrorf("unknown command %d", r.cmd)
	}
	return nil
}

func (d *decoder) count(cmd byte) (int, error) {
	n, err := readU64(d.r)
	if err != nil {
		return 0, err
	}
	if n > uint64(d.lim.maxKeys) {
		return 0, protoErrorf("%s with %d keys exceeds MaxKeysPerRequest %d", cmdName(cmd), n, d.lim.maxKeys)
	}
	return int(n), nil
}

func (d *decoder) key(r *request) error {
	n, err := readU64(d.r)
	if err != nil {
		return err
	}
	if n > uint64(d.lim.maxKeyLen) {
		return protoErrorf("%s key of %d bytes exceeds MaxKeyLen %d", cmdName(r.cmd), n, d.lim.maxKeyLen)
	}
	if err := d.charge(entryOverhead); err != nil {
		return err
	}
	b, err := d.bytes(int(n))
	if err != nil {
		return err
	}
	r.keys = append(r.keys, string(b))
	return nil
}

func (d *decoder) value(r *request) error {
	n, err := readU64(d.r)
	if err != nil {
		return err
	}
	if n > uint64(d.lim.maxValueLen) {
		return protoErrorf("%s value of %d bytes exceeds MaxValueLen %d", cmdName(r.cmd), n, d.lim.maxValueLen)
	}
	if err := d.charge(entryOverhead); err != nil {
		return err
	}
	b, err := d.bytes(int(n))
	if err != nil {
		return err
	}
	r.values = append(r.values, b)
	return nil
}

// firstGrowth is the smallest buffer bytes allocates for a blob.
const firstGrowth = 512

// bytes reads n bytes, growing the result only by what has arrived (at most
// doubling it) and charging every growth to the budget before allocating
// it. The result's capacity is exactly n, so what the store charges for a
// stored value (its capacity) is what decoding charged.
func (d *decoder) bytes(n int) ([]byte, error) {
	b := []byte{}
	for len(b) < n {
		// Peek blocks until at least one byte arrived, without allocating.
		if _, err := d.r.Peek(1); err != nil {
			return nil, err
		}
		avail := min(d.r.Buffered(), n-len(b))
		if len(b)+avail > cap(b) {
			grown := min(n, max(2*cap(b), len(b)+avail, firstGrowth))
			if err := d.charge(int64(grown - cap(b))); err != nil {
				return nil, err
			}
			nb := make([]byte, len(b), grown)
			copy(nb, b)
			b = nb
		}
		m, err := d.r.Read(b[len(b) : len(b)+avail])
		b = b[:len(b)+m]
		if err != nil {
			return nil, err
		}
	}
	return b, nil
}
