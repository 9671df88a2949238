// Package trace reads gpubridge's collective trace records (schema
// gpubridge.trace/v1: trace files, flight-recorder dumps, and torch's own
// Flight Recorder dumps) and analyses them: merge (records of every rank
// aligned by group and sequence number, clock offsets applied), summary
// (per op and size: time quantiles, nccl-tests' algbw and busbw, the share
// of each phase), hang (from dumps: who never arrived where, and
// mismatches between ranks), stragglers (ranks that arrive late, scored
// over windows), a Chrome/Perfetto trace export, and a simulator of
// multi-rank traces for measuring the straggler detector. One algorithm per
// file; docs/TRACING.md describes the records, docs/STRAGGLERS.md the
// detector and its measured ROC.
package trace
