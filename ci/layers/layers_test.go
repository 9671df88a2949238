// Package layers checks the import rules of gpubridge's Go packages
// against layers.txt (as tailscale checks depaware.txt): a package imports
// only lower layers, tools/ and ci/ stand on top, and no library imports
// the command-line layer.
package layers

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const module = "github.com/gpubridge/gpubridge"

// cliOnly are what only tools/ (and lib/cli itself) may depend on.
var cliOnly = []string{module + "/lib/cli", "github.com/alecthomas/kong"}

// pkg is one package of the module as go list describes it.
type pkg struct {
	ImportPath   string
	Imports      []string // its non-test files' imports
	Deps         []string // everything those depend on, transitively
	TestImports  []string
	XTestImports []string
}

// top reports whether path (relative to the module) stands above every
// layer.
func top(path string) bool {
	return path == "tools" || strings.HasPrefix(path, "tools/") || path == "ci" || strings.HasPrefix(path, "ci/")
}

// parseLayers reads layers.txt: "LAYER PATH JOB..." lines, # comments.
func parseLayers(r io.Reader) (map[string]int, error) {
	layers := map[string]int{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 2 {
			return nil, fmt.Errorf("line %d: want LAYER PATH JOB, got %q", n, line)
		}
		l, err := strconv.Atoi(f[0])
		if err != nil || l < 1 {
			return nil, fmt.Errorf("line %d: layer %q is not a number from 1", n, f[0])
		}
		if _, dup := layers[f[1]]; dup {
			return nil, fmt.Errorf("line %d: %s is listed twice", n, f[1])
		}
		layers[f[1]] = l
	}
	return layers, sc.Err()
}

// check returns every broken rule, one sentence each, sorted.
func check(layers map[string]int, pkgs []pkg) []string {
	var bad []string
	seen := map[string]bool{}
	// A dependency on the command-line layer is reported where it is
	// imported, not again in every package that depends on that one.
	direct := map[string]bool{}
	for _, p := range pkgs {
		direct[p.ImportPath] = strings.HasPrefix(p.ImportPath, module+"/") && len(cliUses(p.Imports)) > 0
	}
	for _, p := range pkgs {
		path, ok := strings.CutPrefix(p.ImportPath, module+"/")
		if !ok {
			continue
		}
		seen[path] = true
		layer, listed := layers[path]
		switch {
		case top(path):
			layer = 1 << 30
		case !listed:
			bad = append(bad, fmt.Sprintf("%s is not in ci/layers/layers.txt: give it a line with its layer (the lowest above everything it imports) and its job", path))
			continue
		}
		for _, imp := range p.Imports {
			ip, ours := strings.CutPrefix(imp, module+"/")
			if !ours {
				continue
			}
			switch il, listed := layers[ip]; {
			case top(ip):
				bad = append(bad, fmt.Sprintf("%s imports %s: nothing imports tools/ or ci/ (move what both need into lib/)", path, ip))
			case listed && !top(path) && il >= layer:
				bad = append(bad, fmt.Sprintf("%s (layer %d) imports %s (layer %d): a package imports only lower layers (ci/layers/layers.txt)", path, layer, ip, il))
			}
		}
		if strings.HasPrefix(path, "lib/") && path != "lib/cli" {
			bad = append(bad, cliImports(path, p, direct)...)
		}
	}
	for path := range layers {
		if !seen[path] {
			bad = append(bad, fmt.Sprintf("ci/layers/layers.txt lists %s, which is no package of the module: drop its line", path))
		}
	}
	sort.Strings(bad)
	return bad
}

// cliUses returns the command-line packages among imports.
func cliUses(imports []string) []string {
	var out []string
	for _, c := range cliOnly {
		if slices.Contains(imports, c) {
			out = append(out, c)
		}
	}
	return out
}

// cliImports names lib package p's dependencies on the command-line layer:
// in its files, in its tests, or through a package that is not reported
// itself (another module's).
func cliImports(path string, p pkg, direct map[string]bool) []string {
	var bad []string
	say := func(c, how string) {
		bad = append(bad, fmt.Sprintf("%s imports %s (%s): a library returns typed errors; only tools/ parse command lines and set exit codes", path, c, how))
	}
	for _, c := range cliUses(p.Imports) {
		say(c, "directly")
	}
	for _, c := range cliUses(append(slices.Clone(p.TestImports), p.XTestImports...)) {
		say(c, "in its tests")
	}
	if len(cliUses(p.Imports)) == 0 && !slices.ContainsFunc(p.Deps, func(d string) bool { return direct[d] }) {
		for _, c := range cliUses(p.Deps) {
			say(c, "through another module")
		}
	}
	return bad
}

// goList lists the module's packages.
func goList(t *testing.T) []pkg {
	t.Helper()
	cmd := exec.Command("go", "list", "-json", "./...")
	cmd.Dir = filepath.Join("..", "..")
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	require.NoError(t, cmd.Run(), "go list: %s", stderr.String())
	var pkgs []pkg
	dec := json.NewDecoder(&out)
	for {
		var p pkg
		err := dec.Decode(&p)
		if errors.Is(err, io.EOF) {
			return pkgs
		}
		require.NoError(t, err)
		pkgs = append(pkgs, p)
	}
}

func TestLayers(t *testing.T) {
	f, err := os.Open("layers.txt")
	require.NoError(t, err)
	defer f.Close()
	layers, err := parseLayers(f)
	require.NoError(t, err)
	for _, b := range check(layers, goList(t)) {
		t.Error(b)
	}
}

// The rules catch what they promise, on a made-up module.
func TestCheck(t *testing.T) {
	m := func(s string) string { return module + "/" + s }
	layers := map[string]int{"lib/wire": 1, "lib/cli": 1, "lib/transport": 2, "lib/collective": 3}
	base := func() []pkg {
		return []pkg{
			{ImportPath: m("lib/wire"), Imports: []string{"fmt"}},
			{ImportPath: m("lib/cli"), Imports: []string{"github.com/alecthomas/kong"}},
			{ImportPath: m("lib/transport"), Imports: []string{m("lib/wire")}},
			{ImportPath: m("lib/collective"), Imports: []string{m("lib/transport"), m("lib/wire")}, TestImports: []string{m("lib/collective")}},
			{ImportPath: m("tools/gbx"), Imports: []string{m("lib/cli"), m("lib/collective")}},
		}
	}
	tests := []struct {
		name   string
		change func(ps []pkg) []pkg
		want   []string
	}{
		{"clean", func(ps []pkg) []pkg { return ps }, nil},
		{"upward import", func(ps []pkg) []pkg {
			ps[2].Imports = append(ps[2].Imports, m("lib/collective"))
			return ps
		}, []string{"lib/transport (layer 2) imports lib/collective (layer 3): a package imports only lower layers (ci/layers/layers.txt)"}},
		{"same layer", func(ps []pkg) []pkg {
			ps[0].Imports = append(ps[0].Imports, m("lib/cli"))
			return ps
		}, []string{
			"lib/wire (layer 1) imports lib/cli (layer 1): a package imports only lower layers (ci/layers/layers.txt)",
			"lib/wire imports github.com/gpubridge/gpubridge/lib/cli (directly): a library returns typed errors; only tools/ parse command lines and set exit codes",
		}},
		{"kong through another module", func(ps []pkg) []pkg {
			ps[3].Deps = []string{"example.com/cmdline", "github.com/alecthomas/kong"}
			return append(ps, pkg{ImportPath: "example.com/cmdline", Imports: []string{"github.com/alecthomas/kong"}})
		}, []string{"lib/collective imports github.com/alecthomas/kong (through another module): a library returns typed errors; only tools/ parse command lines and set exit codes"}},
		{"told once, where it is imported", func(ps []pkg) []pkg {
			ps[2].Imports = append(ps[2].Imports, m("lib/cli"))
			ps[3].Deps = []string{m("lib/cli"), m("lib/transport"), "github.com/alecthomas/kong"}
			return ps
		}, []string{"lib/transport imports github.com/gpubridge/gpubridge/lib/cli (directly): a library returns typed errors; only tools/ parse command lines and set exit codes"}},
		{"cli in a library's tests", func(ps []pkg) []pkg {
			ps[2].XTestImports = []string{m("lib/cli")}
			return ps
		}, []string{"lib/transport imports github.com/gpubridge/gpubridge/lib/cli (in its tests): a library returns typed errors; only tools/ parse command lines and set exit codes"}},
		{"a library imports a tool", func(ps []pkg) []pkg {
			ps[2].Imports = append(ps[2].Imports, m("tools/gbx"))
			return ps
		}, []string{"lib/transport imports tools/gbx: nothing imports tools/ or ci/ (move what both need into lib/)"}},
		{"unlisted package", func(ps []pkg) []pkg {
			return append(ps, pkg{ImportPath: m("lib/new")})
		}, []string{"lib/new is not in ci/layers/layers.txt: give it a line with its layer (the lowest above everything it imports) and its job"}},
		{"stale line", func(ps []pkg) []pkg { return ps[1:] },
			[]string{"ci/layers/layers.txt lists lib/wire, which is no package of the module: drop its line"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, check(layers, tt.change(base())))
		})
	}
}

func TestParseLayers(t *testing.T) {
	l, err := parseLayers(strings.NewReader("# comment\n\n1 lib/a  job words\n2 lib/b\n"))
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"lib/a": 1, "lib/b": 2}, l)
	for _, bad := range []string{"x lib/a", "0 lib/a", "1", "1 lib/a\n2 lib/a"} {
		_, err := parseLayers(strings.NewReader(bad))
		assert.Error(t, err, bad)
	}
}
