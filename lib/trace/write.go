package trace

import (
	"bufio"
	"encoding/json"
	"io"
	"sort"
)

// WriteSources writes sources as gpubridge.trace/v1 JSON Lines: each
// source's header, its group records, its collective, phase and step records.
func WriteSources(w io.Writer, srcs []*Source) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	for _, s := range srcs {
		h := s.Header
		h.Schema = Schema
		if h.Kind == "" {
			h.Kind = KindRank
		}
		if err := enc.Encode(h); err != nil {
			return err
		}
		names := make([]string, 0, len(s.Groups))
		for n := range s.Groups {
			names = append(names, n)
		}
		sort.Strings(names)
		for _, n := range names {
			if err := enc.Encode(struct {
				Schema string `json:"schema"`
				Kind   string `json:"kind"`
				Group
			}{Schema, KindGroup, s.Groups[n]}); err != nil {
				return err
			}
		}
		for _, c := range s.Collectives {
			if err := enc.Encode(struct {
				Schema string `json:"schema"`
				Kind   string `json:"kind"`
				Collective
			}{Schema, KindCollective, c}); err != nil {
				return err
			}
		}
		for _, p := range s.Phases {
			if err := enc.Encode(struct {
				Schema string `json:"schema"`
				Kind   string `json:"kind"`
				UserPhase
			}{Schema, KindPhase, p}); err != nil {
				return err
			}
		}
		for _, st := range s.Steps {
			if err := enc.Encode(struct {
				Schema string `json:"schema"`
				Kind   string `json:"kind"`
				Step
			}{Schema, KindStep, st}); err != nil {
				return err
			}
		}
	}
	return bw.Flush()
}
