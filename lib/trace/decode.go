package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Limits bound what the readers accept, so that bad or hostile input is an
// error, never an unbounded allocation.
type Limits struct {
	MaxLine    int   // bytes of one JSON line
	MaxRecords int   // records over all inputs
	MaxFile    int64 // bytes of one torch Flight Recorder dump
}

// DefaultLimits are gbtrace's defaults.
var DefaultLimits = Limits{MaxLine: 1 << 20, MaxRecords: 20_000_000, MaxFile: 256 << 20}

// DecodeError says where an input is bad.
type DecodeError struct {
	Name string // file or "stdin"
	Line int    // 1-based; 0: the whole input
	Err  error
}

func (e *DecodeError) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("%s:%d: %v", e.Name, e.Line, e.Err)
	}
	return fmt.Sprintf("%s: %v", e.Name, e.Err)
}

func (e *DecodeError) Unwrap() error { return e.Err }

// ErrLimit is wrapped by every error about a limit.
var ErrLimit = errors.New("over the limit")

// envelope is what every line is read as first.
type envelope struct {
	Schema string `json:"schema"`
	Kind   string `json:"kind"`
}

// Reader reads records, counting them against one budget.
type Reader struct {
	Limits Limits
	count  int
	rank   int // for a torch dump whose name says none (0 in a Reader from NewReader: unset is -1)
}

// NewReader returns a reader with limits (zero fields: the defaults).
func NewReader(l Limits) *Reader {
	if l.MaxLine <= 0 {
		l.MaxLine = DefaultLimits.MaxLine
	}
	if l.MaxRecords <= 0 {
		l.MaxRecords = DefaultLimits.MaxRecords
	}
	if l.MaxFile <= 0 {
		l.MaxFile = DefaultLimits.MaxFile
	}
	return &Reader{Limits: l, rank: -1}
}

func (rd *Reader) take(n int) error {
	rd.count += n
	if rd.count > rd.Limits.MaxRecords {
		return fmt.Errorf("more than %d records: %w", rd.Limits.MaxRecords, ErrLimit)
	}
	return nil
}

// DecodeLines reads gpubridge JSON Lines: one or more sources, each begun by
// its header record (kind rank or dump), as trace files and dumps are and
// as they come concatenated on a pipe.
func (rd *Reader) DecodeLines(r io.Reader, name string) ([]*Source, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var out []*Source
	var cur *Source
	for line := 1; ; line++ {
		b, err := readLine(br, rd.Limits.MaxLine)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, &DecodeError{name, line, err}
		}
		b = bytes.TrimSpace(b)
		if len(b) == 0 {
			continue
		}
		if err := rd.take(1); err != nil {
			return nil, &DecodeError{name, line, err}
		}
		src, err := decodeRecord(b, cur, name)
		if err != nil {
			return nil, &DecodeError{name, line, err}
		}
		if src != cur {
			out = append(out, src)
			cur = src
		}
	}
	if len(out) == 0 {
		return nil, &DecodeError{name, 0, errors.New("no records")}
	}
	return out, nil
}

// decodeRecord adds one line to cur, or starts a new source with it.
func decodeRecord(b []byte, cur *Source, name string) (*Source, error) {
	var env envelope
	if err := json.Unmarshal(b, &env); err != nil {
		return nil, fmt.Errorf("not a JSON object: %v", err)
	}
	if env.Schema != Schema {
		return nil, fmt.Errorf("schema %q: this gbtrace reads %s", env.Schema, Schema)
	}
	switch env.Kind {
	case KindRank, KindDump:
		s := &Source{Name: name, Format: "trace", Groups: map[string]Group{}}
		if env.Kind == KindDump {
			s.Format = "dump"
		}
		if err := json.Unmarshal(b, &s.Header); err != nil {
			return nil, fmt.Errorf("%s record: %v", env.Kind, err)
		}
		if s.Header.Rank < 0 {
			return nil, fmt.Errorf("%s record: rank %d", env.Kind, s.Header.Rank)
		}
		return s, nil
	}
	if cur == nil {
		return nil, fmt.Errorf("a %q record before any rank or dump record (a trace file starts with one)", env.Kind)
	}
	switch env.Kind {
	case KindGroup:
		var g Group
		if err := json.Unmarshal(b, &g); err != nil {
			return nil, fmt.Errorf("group record: %v", err)
		}
		if g.Size < 1 || len(g.Ranks) != g.Size {
			return nil, fmt.Errorf("group record %q: %d ranks for size %d", g.Name, len(g.Ranks), g.Size)
		}
		cur.Groups[g.Name] = g
	case KindCollective:
		var c Collective
		if err := json.Unmarshal(b, &c); err != nil {
			return nil, fmt.Errorf("collective record: %v", err)
		}
		if err := c.check(cur.Header.Rank); err != nil {
			return nil, err
		}
		cur.Collectives = append(cur.Collectives, c)
	case KindPhase:
		var p UserPhase
		if err := json.Unmarshal(b, &p); err != nil {
			return nil, fmt.Errorf("phase record: %v", err)
		}
		cur.Phases = append(cur.Phases, p)
	case KindStep:
		var st Step
		if err := json.Unmarshal(b, &st); err != nil {
			return nil, fmt.Errorf("step record: %v", err)
		}
		if err := st.check(cur.Header.Rank); err != nil {
			return nil, err
		}
		cur.Steps = append(cur.Steps, st)
	default:
		cur.Skipped++ // a kind of a later version: fields and kinds may be added within v1
	}
	return cur, nil
}

func (c *Collective) check(rank int) error {
	switch {
	case c.Rank != rank:
		return fmt.Errorf("collective record of rank %d in rank %d's records", c.Rank, rank)
	case c.Seq < 0:
		return fmt.Errorf("collective record: seq %d", c.Seq)
	case c.Group.Size < 1 || c.Group.Rank < 0 || c.Group.Rank >= c.Group.Size:
		return fmt.Errorf("collective record #%d: group rank %d of size %d", c.Seq, c.Group.Rank, c.Group.Size)
	case c.Result != ResultOK && c.Result != ResultError && c.Result != ResultInFlight:
		return fmt.Errorf("collective record #%d: result %q", c.Seq, c.Result)
	}
	if b := c.Bridge; b != nil {
		switch {
		case b.AllArrived < b.Start || b.End < b.AllArrived:
			return fmt.Errorf("collective record #%d: bridge start %d, all_arrived %d, end %d are not in order", c.Seq, b.Start, b.AllArrived, b.End)
		case len(b.Peers) > maxBridgePeers:
			return fmt.Errorf("collective record #%d: %d bridge peers (at most %d): %w", c.Seq, len(b.Peers), maxBridgePeers, ErrLimit)
		}
		for _, p := range b.Peers {
			if len(p.BlockedNs) > maxBridgeStreams {
				return fmt.Errorf("collective record #%d: bridge peer %d: %d streams (at most %d): %w", c.Seq, p.Member, len(p.BlockedNs), maxBridgeStreams, ErrLimit)
			}
		}
	}
	return nil
}

func (s *Step) check(rank int) error {
	switch {
	case s.Rank != rank:
		return fmt.Errorf("step record of rank %d in rank %d's records", s.Rank, rank)
	case s.Step < 0:
		return fmt.Errorf("step record: step %d", s.Step)
	case s.Samples < 0 || s.Samples > MaxStepSamples:
		return fmt.Errorf("step record #%d: samples %d (0 to %d)", s.Step, s.Samples, int64(MaxStepSamples))
	case s.End < s.Start:
		return fmt.Errorf("step record #%d: ends (%d) before it starts (%d)", s.Step, s.End, s.Start)
	case (s.GPUStart == nil) != (s.GPUEnd == nil) || (s.GPUStart != nil && *s.GPUEnd < *s.GPUStart):
		return fmt.Errorf("step record #%d: gpu_start and gpu_end must come together, in order", s.Step)
	}
	return nil
}

// readLine reads one line of at most max bytes (without the newline).
func readLine(br *bufio.Reader, max int) ([]byte, error) {
	var buf []byte
	for {
		frag, err := br.ReadSlice('\n')
		if len(buf)+len(frag) > max+1 {
			return nil, fmt.Errorf("a line longer than %d bytes: %w", max, ErrLimit)
		}
		buf = append(buf, frag...)
		switch {
		case err == bufio.ErrBufferFull:
			continue
		case err == io.EOF && len(buf) > 0:
			return buf, nil
		case err != nil:
			return nil, err
		}
		return buf[:len(buf)-1], nil
	}
}

// Load reads every input: files (gpubridge records, or a torch Flight
// Recorder dump in JSON or pickle form, told apart by their first bytes),
// directories (every regular file in them but hidden ones, sorted by
// name), or, with no
// path, stdin (gpubridge records, or one torch dump).
func (rd *Reader) Load(paths []string, stdin io.Reader) ([]*Source, error) {
	if len(paths) == 0 {
		return rd.decodeAny(stdin, "stdin", -1)
	}
	var out []*Source
	for _, p := range paths {
		st, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		files := []string{p}
		if st.IsDir() {
			entries, err := os.ReadDir(p)
			if err != nil {
				return nil, err
			}
			files = files[:0]
			for _, e := range entries {
				// Hidden files are passed over: a dump being written is one.
				if e.Type().IsRegular() && !strings.HasPrefix(e.Name(), ".") {
					files = append(files, filepath.Join(p, e.Name()))
				}
			}
			sort.Strings(files)
			if len(files) == 0 {
				return nil, fmt.Errorf("%s: no files", p)
			}
		}
		for _, f := range files {
			srcs, err := rd.loadFile(f)
			if err != nil {
				return nil, err
			}
			out = append(out, srcs...)
		}
	}
	return out, nil
}

func (rd *Reader) loadFile(path string) ([]*Source, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := rankFromName(path)
	if r < 0 {
		r = rd.rank
	}
	return rd.decodeAny(f, path, r)
}

// decodeAny tells gpubridge records from torch's dumps by the first bytes.
func (rd *Reader) decodeAny(r io.Reader, name string, rank int) ([]*Source, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, _ := br.Peek(256)
	head = bytes.TrimLeft(head, " \t\r\n")
	switch {
	case len(head) > 0 && head[0] == pickleProto:
		return rd.decodeFR(br, name, rank, true)
	case bytes.HasPrefix(head, []byte("{")) && !bytes.Contains(head, []byte(`"schema"`)):
		return rd.decodeFR(br, name, rank, false)
	}
	return rd.DecodeLines(br, name)
}

// LoadRank is Load with the rank of a torch dump whose name ends in no
// number (and of one on stdin); -1: none.
func (rd *Reader) LoadRank(paths []string, stdin io.Reader, rank int) ([]*Source, error) {
	if len(paths) == 0 {
		return rd.decodeAny(stdin, "stdin", rank)
	}
	rd.rank = rank
	return rd.Load(paths, stdin)
}
