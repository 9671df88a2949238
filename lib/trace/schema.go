package trace

// Schema is the schema of every record the plugin writes (and of what
// gbtrace fr makes of torch's dumps).
const Schema = "gpubridge.trace/v1"

// Record kinds.
const (
	KindRank       = "rank"       // a trace file's first line: who wrote it, its clock
	KindDump       = "dump"       // a dump's first line: the same, why, and each group's progress
	KindGroup      = "group"      // a group's name, ranks and this rank's place in it
	KindCollective = "collective" // one collective on one rank
	KindPhase      = "phase"      // a step of the user's own, outside any collective
	KindStep       = "step"       // a training step the user marked, with its samples (gpubridge.observe.step)
)

// Results of a collective record.
const (
	ResultOK       = "ok"
	ResultError    = "error"
	ResultInFlight = "in flight"
)

// Clock maps a rank's clock onto the reference rank's: a time t of this
// rank is t - OffsetNs there, within ErrorNs. OffsetNs nil: not measured.
type Clock struct {
	OffsetNs *int64 `json:"offset_ns"`
	ErrorNs  *int64 `json:"error_ns"`
	Ref      int    `json:"ref"`
	Method   string `json:"method"`
	Boot     string `json:"boot,omitempty"`
}

// Header is a source's first record (kind rank or dump).
type Header struct {
	Schema string `json:"schema"`
	Kind   string `json:"kind"`
	Rank   int    `json:"rank"`
	Host   string `json:"host,omitempty"`
	PID    int    `json:"pid,omitempty"`
	Clock  Clock  `json:"clock"`
	MonoNs int64  `json:"mono_ns"`
	WallNs int64  `json:"wall_ns"`
	// Hardware is the rank's hardware class (absent in records of older
	// writers and in torch's dumps).
	Hardware *Hardware `json:"hardware,omitempty"`
	// Dumps only.
	Reason  string        `json:"reason,omitempty"`
	Buffer  int           `json:"buffer,omitempty"`
	Records int           `json:"records,omitempty"`
	Groups  []GroupStatus `json:"groups,omitempty"`
}

// Hardware says what a rank computes on: its vendor and GPU model (from
// the topology's probe records) and the class the heterogeneity-aware
// diagnosis groups it in (docs/STRAGGLERS.md): "<vendor> <model>", "<vendor>
// (simulated)" in CPU simulation, or what GPUBRIDGE_HW_CLASS declares.
type Hardware struct {
	Vendor    string `json:"vendor,omitempty"`
	Model     string `json:"model,omitempty"`
	Class     string `json:"class"`
	Simulated bool   `json:"simulated,omitempty"`
	Declared  bool   `json:"declared,omitempty"` // the class came from GPUBRIDGE_HW_CLASS
}

// GroupStatus is a group's progress when a dump was written: the sequence
// numbers submitted (called) and completed on that rank.
type GroupStatus struct {
	Name      string `json:"name"`
	Rank      int    `json:"rank"`
	Size      int    `json:"size"`
	Submitted int64  `json:"submitted"`
	Completed int64  `json:"completed"`
}

// Group is a group record: the group's global ranks and this rank's place.
type Group struct {
	Name   string `json:"name"`
	Rank   int    `json:"rank"`
	Size   int    `json:"size"`
	Ranks  []int  `json:"ranks"`
	Island string `json:"island,omitempty"`
	Leader bool   `json:"leader,omitempty"`
	Peers  []int  `json:"peers,omitempty"`
	Policy string `json:"policy,omitempty"`
	Device string `json:"device,omitempty"`
}

// GroupRef names a collective's group.
type GroupRef struct {
	Name string `json:"name"`
	Rank int    `json:"rank"`
	Size int    `json:"size"`
}

// Phase is one step of a collective on one rank (host ns; device ns mapped
// onto the host clock when there are any). End nil: still running.
type Phase struct {
	Name     string `json:"name"`
	Start    int64  `json:"start"`
	End      *int64 `json:"end"`
	GPUStart *int64 `json:"gpu_start,omitempty"`
	GPUEnd   *int64 `json:"gpu_end,omitempty"`
}

// Collective is one collective on one rank.
type Collective struct {
	Rank     int      `json:"rank"`
	Group    GroupRef `json:"group"`
	Seq      int64    `json:"seq"`
	Op       string   `json:"op"`
	Call     string   `json:"call,omitempty"`
	Async    bool     `json:"async,omitempty"`
	Bytes    int64    `json:"bytes"`
	DType    *string  `json:"dtype"`
	ReduceOp *string  `json:"reduce_op"`
	Root     *int     `json:"root"`
	Policy   string   `json:"policy,omitempty"`
	Codec    string   `json:"codec,omitempty"`
	Island   string   `json:"island,omitempty"`
	Leader   bool     `json:"leader,omitempty"`
	Peers    []int    `json:"peers,omitempty"`
	Device   string   `json:"device,omitempty"`
	Thread   string   `json:"thread,omitempty"`
	Arrived  int64    `json:"arrived"`
	Start    *int64   `json:"start"`
	End      *int64   `json:"end"`
	Phases   []Phase  `json:"phases"`
	Result   string   `json:"result"`
	Error    string   `json:"error,omitempty"`
	Step     string   `json:"step,omitempty"`
	StepNs   *int64   `json:"step_ns,omitempty"`
	Bridge   *Bridge  `json:"bridge,omitempty"`
}

// Bridge is what gbbridge measured of a leader's bridged collective
// (docs/TRACING.md §7), on the rank's clock.
type Bridge struct {
	Start         int64        `json:"start"`
	AllArrived    int64        `json:"all_arrived"` // every peer's first frame was in
	End           int64        `json:"end"`
	BytesSent     int64        `json:"bytes_sent"`
	BytesReceived int64        `json:"bytes_received"`
	CodecNs       int64        `json:"codec_ns"`
	ReduceNs      int64        `json:"reduce_ns"`
	Peers         []BridgePeer `json:"peers"`
	PeersCut      bool         `json:"peers_cut,omitempty"`
}

// BridgePeer is one other bridge member: its global rank, when its first
// frame came after the bridge's start (nil: none came), and per stream the
// ns waited on it.
type BridgePeer struct {
	Member        int     `json:"member"`
	Rank          *int    `json:"rank"`
	ArrivalSkewNs *int64  `json:"arrival_skew_ns"`
	BlockedNs     []int64 `json:"blocked_ns"`
}

// Bounds of a bridge part (lib/collective.MaxMembers, transport.MaxStreams).
const (
	maxBridgePeers   = 1024
	maxBridgeStreams = 64
)

// UserPhase is a step the user marked outside any collective
// (gpubridge.observe.phase).
type UserPhase struct {
	Rank   int    `json:"rank"`
	Name   string `json:"name"`
	Thread string `json:"thread,omitempty"`
	Start  int64  `json:"start"`
	End    int64  `json:"end"`
}

// Step is a training step the user marked on one rank
// (gpubridge.observe.step): its index (the same step has the same index on
// every rank), the samples it computed, and when it began and ended; on a
// GPU also when the rank's current stream reached its start and its end
// (CUDA events on the host clock, as phases' gpu_start and gpu_end).
type Step struct {
	Rank     int    `json:"rank"`
	Step     int64  `json:"step"`
	Samples  int64  `json:"samples"`
	Start    int64  `json:"start"`
	End      int64  `json:"end"`
	GPUStart *int64 `json:"gpu_start,omitempty"`
	GPUEnd   *int64 `json:"gpu_end,omitempty"`
}

// MaxStepSamples bounds a step record's samples.
const MaxStepSamples = 1 << 40

// Source is what one process (one rank) wrote: a trace file, a dump, or a
// torch Flight Recorder dump converted.
type Source struct {
	Name        string // the file, or "stdin"
	Format      string // "trace", "dump", "torch-fr"
	Header      Header
	Groups      map[string]Group
	Collectives []Collective
	Phases      []UserPhase
	Steps       []Step
	Skipped     int // records of kinds this version does not know
}

// Rank is the source's global rank.
func (s *Source) Rank() int { return s.Header.Rank }

// Offset is the ns to subtract from this source's times to put them on
// the reference's clock (0 when not measured), and whether it was.
func (s *Source) Offset() (int64, bool) {
	if s.Header.Clock.OffsetNs == nil {
		return 0, false
	}
	return *s.Header.Clock.OffsetNs, true
}
