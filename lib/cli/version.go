package cli

import "runtime/debug"

// Version is the gpubridge release; builds may override it with
// -ldflags "-X github.com/gpubridge/gpubridge/lib/cli.Version=...".
var Version = "0.1.0-dev"

// Commit returns the VCS revision the binary was built from, or "unknown".
func Commit() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	rev, dirty := "unknown", false
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
			if len(rev) > 12 {
				rev = rev[:12]
			}
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if dirty {
		rev += "-dirty"
	}
	return rev
}

// VersionString is what --version prints.
func VersionString(tool string) string {
	return tool + " " + Version + " (" + Commit() + ")"
}
