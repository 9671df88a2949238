package trace

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// The Python pickles torch's Flight Recorder writes (dicts, lists, tuples,
// strings, numbers, booleans, None) are read by a restricted unpickler:
// the opcodes that build plain data only. Anything that would name a Python
// class or call one (GLOBAL, REDUCE, BUILD, ...) is refused, so a dump can
// never run code, and every length is checked against the input.

const pickleProto = 0x80

// maxPickleDepth bounds nesting (a list that holds itself, too).
const maxPickleDepth = 64

type pList struct{ items []any }

type pDict struct {
	keys []string
	m    map[string]any
}

type pMark struct{}

// Unpickle decodes a pickle of plain data into Go values: map[string]any
// (keys that are not strings are formatted), []any, string, int64, float64,
// bool, []byte and nil.
func Unpickle(b []byte) (any, error) {
	u := unpickler{b: b, memo: map[uint32]any{}}
	v, err := u.run()
	if err != nil {
		return nil, fmt.Errorf("pickle at byte %d: %w", u.pos, err)
	}
	budget := 4*len(b) + 64 // values shared through the memo are copied once per use: bounded
	return plain(v, 0, &budget)
}

type unpickler struct {
	b     []byte
	pos   int
	stack []any
	memo  map[uint32]any
}

func (u *unpickler) take(n uint64) ([]byte, error) {
	if n > uint64(len(u.b)-u.pos) {
		return nil, errors.New("truncated")
	}
	s := u.b[u.pos : u.pos+int(n)]
	u.pos += int(n)
	return s, nil
}

func (u *unpickler) uint(n int) (uint64, error) {
	s, err := u.take(uint64(n))
	if err != nil {
		return 0, err
	}
	var buf [8]byte
	copy(buf[:], s)
	return binary.LittleEndian.Uint64(buf[:]), nil
}

func (u *unpickler) push(v any) { u.stack = append(u.stack, v) }

func (u *unpickler) pop() (any, error) {
	if len(u.stack) == 0 {
		return nil, errors.New("stack underflow")
	}
	v := u.stack[len(u.stack)-1]
	u.stack = u.stack[:len(u.stack)-1]
	if _, ok := v.(pMark); ok {
		return nil, errors.New("a mark where a value was expected")
	}
	return v, nil
}

// popMark pops the values above the topmost mark, and the mark.
func (u *unpickler) popMark() ([]any, error) {
	for i := len(u.stack) - 1; i >= 0; i-- {
		if _, ok := u.stack[i].(pMark); ok {
			vals := append([]any(nil), u.stack[i+1:]...)
			u.stack = u.stack[:i]
			return vals, nil
		}
	}
	return nil, errors.New("no mark")
}

func (u *unpickler) top() (any, error) {
	if len(u.stack) == 0 {
		return nil, errors.New("stack underflow")
	}
	return u.stack[len(u.stack)-1], nil
}

func (u *unpickler) str(n uint64) error {
	s, err := u.take(n)
	if err != nil {
		return err
	}
	u.push(string(s))
	return nil
}

func (u *unpickler) run() (any, error) {
	for u.pos < len(u.b) {
		op := u.b[u.pos]
		u.pos++
		if err := u.step(op); err != nil {
			if errors.Is(err, errStop) {
				if len(u.stack) != 1 {
					return nil, fmt.Errorf("%d values left at STOP", len(u.stack))
				}
				return u.stack[0], nil
			}
			return nil, err
		}
	}
	return nil, errors.New("no STOP")
}

var errStop = errors.New("stop")

func (u *unpickler) step(op byte) error {
	switch op {
	case 0x80: // PROTO
		_, err := u.take(1)
		return err
	case 0x95: // FRAME
		_, err := u.take(8)
		return err
	case '.':
		return errStop
	case '(':
		u.push(pMark{})
	case '}':
		u.push(&pDict{m: map[string]any{}})
	case ']':
		u.push(&pList{})
	case ')':
		u.push(&pList{})
	case 0x8f: // EMPTY_SET
		u.push(&pList{})
	case 'N':
		u.push(nil)
	case 0x88:
		u.push(true)
	case 0x89:
		u.push(false)
	case 'K', 'M':
		n := 1
		if op == 'M' {
			n = 2
		}
		v, err := u.uint(n)
		if err != nil {
			return err
		}
		u.push(int64(v))
	case 'J':
		v, err := u.uint(4)
		if err != nil {
			return err
		}
		u.push(int64(int32(uint32(v))))
	case 0x8a, 0x8b: // LONG1, LONG4
		n, err := u.uint(map[byte]int{0x8a: 1, 0x8b: 4}[op])
		if err != nil {
			return err
		}
		if n > 8 {
			return fmt.Errorf("an integer of %d bytes (at most 8)", n)
		}
		s, err := u.take(n)
		if err != nil {
			return err
		}
		var v int64
		for i := len(s) - 1; i >= 0; i-- {
			v = v<<8 | int64(s[i])
		}
		if n > 0 && n < 8 && s[n-1]&0x80 != 0 {
			v -= 1 << (8 * n)
		}
		u.push(v)
	case 'G':
		s, err := u.take(8)
		if err != nil {
			return err
		}
		u.push(math.Float64frombits(binary.BigEndian.Uint64(s)))
	case 'X', 0x8c, 0x8d, 'T', 'U', 'B', 'C', 0x8e: // strings and bytes
		width := map[byte]int{'X': 4, 0x8c: 1, 0x8d: 8, 'T': 4, 'U': 1, 'B': 4, 'C': 1, 0x8e: 8}[op]
		n, err := u.uint(width)
		if err != nil {
			return err
		}
		return u.str(n)
	case 'q', 'r', 0x94: // BINPUT, LONG_BINPUT, MEMOIZE
		var idx uint64
		var err error
		switch op {
		case 'q':
			idx, err = u.uint(1)
		case 'r':
			idx, err = u.uint(4)
		default:
			idx = uint64(len(u.memo))
		}
		if err != nil {
			return err
		}
		v, err := u.top()
		if err != nil {
			return err
		}
		u.memo[uint32(idx)] = v
	case 'h', 'j':
		n := 1
		if op == 'j' {
			n = 4
		}
		idx, err := u.uint(n)
		if err != nil {
			return err
		}
		v, ok := u.memo[uint32(idx)]
		if !ok {
			return fmt.Errorf("memo %d was never stored", idx)
		}
		u.push(v)
	case '0': // POP
		_, err := u.pop()
		return err
	case '1': // POP_MARK
		_, err := u.popMark()
		return err
	case '2': // DUP
		v, err := u.top()
		if err != nil {
			return err
		}
		u.push(v)
	case 't', 'l', 0x91: // TUPLE, LIST, FROZENSET: the marked values
		vals, err := u.popMark()
		if err != nil {
			return err
		}
		u.push(&pList{items: vals})
	case 0x85, 0x86, 0x87: // TUPLE1..3
		n := int(op - 0x84)
		if len(u.stack) < n {
			return errors.New("stack underflow")
		}
		vals := append([]any(nil), u.stack[len(u.stack)-n:]...)
		u.stack = u.stack[:len(u.stack)-n]
		for _, v := range vals {
			if _, ok := v.(pMark); ok {
				return errors.New("a mark in a tuple")
			}
		}
		u.push(&pList{items: vals})
	case 'a': // APPEND
		v, err := u.pop()
		if err != nil {
			return err
		}
		return u.appendTo(v)
	case 'e', 0x90: // APPENDS, ADDITEMS
		vals, err := u.popMark()
		if err != nil {
			return err
		}
		return u.appendTo(vals...)
	case 'd': // DICT
		vals, err := u.popMark()
		if err != nil {
			return err
		}
		d := &pDict{m: map[string]any{}}
		u.push(d)
		return setItems(d, vals)
	case 's', 'u': // SETITEM, SETITEMS
		var vals []any
		if op == 's' {
			v, err := u.pop()
			if err != nil {
				return err
			}
			k, err := u.pop()
			if err != nil {
				return err
			}
			vals = []any{k, v}
		} else {
			var err error
			if vals, err = u.popMark(); err != nil {
				return err
			}
		}
		t, err := u.top()
		if err != nil {
			return err
		}
		d, ok := t.(*pDict)
		if !ok {
			return errors.New("SETITEM on something that is not a dict")
		}
		return setItems(d, vals)
	default:
		return fmt.Errorf("opcode 0x%02x is not allowed (only plain data is read)", op)
	}
	return nil
}

func (u *unpickler) appendTo(vals ...any) error {
	t, err := u.top()
	if err != nil {
		return err
	}
	l, ok := t.(*pList)
	if !ok {
		return errors.New("APPEND to something that is not a list")
	}
	l.items = append(l.items, vals...)
	return nil
}

func setItems(d *pDict, vals []any) error {
	if len(vals)%2 != 0 {
		return errors.New("a dict's items are not pairs")
	}
	for i := 0; i < len(vals); i += 2 {
		var k string
		switch kv := vals[i].(type) {
		case string:
			k = kv
		case int64, float64, bool, nil:
			k = fmt.Sprint(kv)
		default:
			return fmt.Errorf("a dict key of type %T", vals[i])
		}
		if _, seen := d.m[k]; !seen {
			d.keys = append(d.keys, k)
		}
		d.m[k] = vals[i+1]
	}
	return nil
}

// plain turns the unpickler's containers into Go maps and slices, within a
// budget of values.
func plain(v any, depth int, budget *int) (any, error) {
	if depth > maxPickleDepth {
		return nil, fmt.Errorf("nested deeper than %d", maxPickleDepth)
	}
	if *budget--; *budget < 0 {
		return nil, fmt.Errorf("more values than 4 per input byte (shared values repeated): %w", ErrLimit)
	}
	switch t := v.(type) {
	case *pList:
		out := make([]any, len(t.items))
		for i, x := range t.items {
			p, err := plain(x, depth+1, budget)
			if err != nil {
				return nil, err
			}
			out[i] = p
		}
		return out, nil
	case *pDict:
		out := make(map[string]any, len(t.m))
		for _, k := range t.keys {
			p, err := plain(t.m[k], depth+1, budget)
			if err != nil {
				return nil, err
			}
			out[k] = p
		}
		return out, nil
	case string:
		return t, nil
	}
	return v, nil
}
