package feed

// ServeSchema is the schema of the line `gbbridge serve` prints when ready.
const ServeSchema = "gpubridge.bridge-serve/v1"

// ReadyLine is what `gbbridge serve` prints on stdout, as one JSON line,
// once the bridge is up and the feed socket listens: the plugin reads it
// before it connects.
type ReadyLine struct {
	Schema    string `json:"schema"`
	Feed      string `json:"feed"`
	Member    int    `json:"member"`
	Members   int    `json:"members"`
	Rank      int    `json:"rank"`
	PID       int    `json:"pid"`
	Transport string `json:"transport"`
	Version   int    `json:"feed_version"`
	// Bridge0 says whether serve joined bridge 0, the leaders' bridge
	// (false: gbbridge serve --no-bridge; then Member is -1, Members 0 and
	// Transport "none").
	Bridge0 bool `json:"bridge0"`
}
