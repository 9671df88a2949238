package discover

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Claim names the process a rank's record comes from. Before anything else a
// rank compare-and-sets its claim under "claim/<rank>" in the namespace; a
// second process claiming the same rank (another job that reached this job's
// store through the same MASTER_PORT) finds the first one's claim there and
// fails, naming it, instead of adopting this job's outcome.
type Claim struct {
	Host string `json:"host"`
	PID  int    `json:"pid"`
	// Start is the process's start time (clock ticks after boot, from
	// /proc/PID/stat; 0 when unknown), so that a reused pid is not taken
	// for the same process.
	Start uint64 `json:"start,omitempty"`
}

// NewClaim returns the claim of process pid on this host.
func NewClaim(pid int) *Claim {
	host, _ := os.Hostname()
	return &Claim{Host: host, PID: pid, Start: procStart(pid)}
}

// Same reports whether c and o name the same process: the same rank process
// may run discovery again (its pid and start time are the same), another
// process may not.
func (c *Claim) Same(o *Claim) bool {
	return o != nil && c.Host == o.Host && c.PID == o.PID && (c.Start == o.Start || c.Start == 0 || o.Start == 0)
}

func (c *Claim) String() string {
	return fmt.Sprintf("pid %d on host %s", c.PID, c.Host)
}

// encode returns the claim's JSON (the value compared and set in the store).
func (c *Claim) encode() []byte {
	b, _ := json.Marshal(c) // a struct of strings and numbers always encodes
	return b
}

// MaxClaimBytes bounds a claim read from the store.
const MaxClaimBytes = 4 << 10

// decodeClaim parses a claim read from the store.
func decodeClaim(b []byte) (*Claim, error) {
	if len(b) > MaxClaimBytes {
		return nil, fmt.Errorf("claim of %d bytes, over the %d-byte limit", len(b), MaxClaimBytes)
	}
	var c Claim
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, JSONError("claim", err)
	}
	if c.PID <= 0 {
		return nil, fmt.Errorf("claim %q names no pid", truncateText(string(b), 64))
	}
	return &c, nil
}

func claimKey(rank int) string { return "claim/" + strconv.Itoa(rank) }

// conflictAdvice ends every message about two jobs in one namespace.
const conflictAdvice = "is another job using this store (same MASTER_PORT)? give each job its own port or run id (TORCHELASTIC_RUN_ID, or GPUBRIDGE_NAMESPACE)"

// claimConflict is the problem of a rank whose claim another process holds.
func claimConflict(ns string, rank int, held []byte, mine *Claim) string {
	other, err := decodeClaim(held)
	if err != nil {
		return fmt.Sprintf("rank %d is already claimed in namespace %s by something that is not gbdiscover (%v; this is %s): %s",
			rank, ns, err, mine, conflictAdvice)
	}
	return fmt.Sprintf("rank %d is already claimed in namespace %s by %s (this is %s): %s", rank, ns, other, mine, conflictAdvice)
}

// claimProblems checks that every record comes from the process that holds
// its rank's claim; claims[r] is the stored claim of rank r (nil: none). A
// record without a claim is accepted only when its rank has none either
// (the torch plugin's publish_failure writes such records).
func claimProblems(ns string, recs []*Record, claims [][]byte) []string {
	var problems []string
	for r, rec := range recs {
		if rec == nil || r >= len(claims) {
			continue
		}
		held := claims[r]
		switch {
		case held == nil && rec.Claim == nil:
		case held == nil:
			problems = append(problems, fmt.Sprintf("the record of rank %d comes from %s, which holds no claim on rank %d in namespace %s: %s",
				r, rec.Claim, r, ns, conflictAdvice))
		case rec.Claim == nil:
			problems = append(problems, fmt.Sprintf("the record of rank %d carries no claim, but %s: %s",
				r, claimHolder(ns, r, held), conflictAdvice))
		default:
			if c, err := decodeClaim(held); err != nil || !c.Same(rec.Claim) {
				problems = append(problems, fmt.Sprintf("the record of rank %d comes from %s, but %s: %s",
					r, rec.Claim, claimHolder(ns, r, held), conflictAdvice))
			}
		}
	}
	return problems
}

func claimHolder(ns string, rank int, held []byte) string {
	if c, err := decodeClaim(held); err == nil {
		return fmt.Sprintf("rank %d is claimed in namespace %s by %s", rank, ns, c)
	}
	return fmt.Sprintf("rank %d is claimed in namespace %s by something that is not gbdiscover", rank, ns)
}

// procStart returns the start time of process pid in clock ticks after
// boot (field 22 of /proc/PID/stat), or 0.
func procStart(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	// The command name (field 2) is in parentheses and may hold spaces and
	// parentheses: the fields after it start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	fields := strings.Fields(string(b[i+1:]))
	// fields[0] is field 3 (state); the start time is field 22.
	if len(fields) < 20 {
		return 0
	}
	n, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return 0
	}
	return n
}

func truncateText(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}
