// Command testreport makes the skips of make test visible.
//
//	go test -json ./... | testreport tee FILE
//
// writes the JSON stream to FILE and prints what a plain `go test` prints:
// each package's result, the output of failed tests, build errors. It exits
// 1 when the stream reports a failure (make's pipefail also sees go test's
// status).
//
//	testreport skips [-root auto|yes|no] DIR
//
// lists every skipped test recorded in DIR, with its reason: *.json (go test
// -json streams), *.xml (pytest --junitxml) and *.skip (lines "NAME<TAB>
// REASON", for skips of make's own steps). A Go test skipped in one stream
// but passed in another (a test that runs only without -race) says so.
// Skip reasons that begin with "needs root" mark tests that need root: when
// running as root (-root auto, the default, asks the effective uid) such a
// skip is a failure, exit 1 — a root-only test must never pass by skipping
// under CI.
package main

import (
	"bufio"
	"encoding/json"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// RootPrefix begins the skip reason of every test that needs root.
const RootPrefix = "needs root"

// modulePrefix is trimmed from package paths in the listing.
const modulePrefix = "github.com/gpubridge/gpubridge/"

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	usage := func() int {
		fmt.Fprintln(stderr, "usage: testreport tee FILE < go-test-json\n       testreport skips [-root auto|yes|no] DIR")
		return 2
	}
	if len(args) == 0 {
		return usage()
	}
	switch args[0] {
	case "tee":
		if len(args) != 2 {
			return usage()
		}
		f, err := os.Create(args[1])
		if err != nil {
			fmt.Fprintln(stderr, "testreport:", err)
			return 2
		}
		failed, err := tee(stdin, f, stdout)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			fmt.Fprintln(stderr, "testreport:", err)
			return 2
		}
		if failed {
			return 1
		}
		return 0
	case "skips":
		fs := flag.NewFlagSet("skips", flag.ContinueOnError)
		fs.SetOutput(stderr)
		root := fs.String("root", "auto", "judge skips as root: auto (the effective uid), yes or no")
		if err := fs.Parse(args[1:]); err != nil || fs.NArg() != 1 {
			return usage()
		}
		asRoot := *root == "yes" || (*root == "auto" && os.Geteuid() == 0)
		if *root != "auto" && *root != "yes" && *root != "no" {
			return usage()
		}
		skips, err := collect(fs.Arg(0))
		if err != nil {
			fmt.Fprintln(stderr, "testreport:", err)
			return 2
		}
		if report(stdout, skips, asRoot) {
			return 1
		}
		return 0
	}
	return usage()
}

// event is one line of go test -json (cmd/test2json).
type event struct {
	Action     string
	Package    string
	Test       string
	Output     string
	ImportPath string
}

// tee copies the go test -json stream in to raw and prints to out what
// plain go test prints. It reports whether the stream holds a failure.
func tee(in io.Reader, raw, out io.Writer) (bool, error) {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	buffered := map[string][]string{} // a running test's output, printed if it fails
	failed := false
	for sc.Scan() {
		line := sc.Bytes()
		if _, err := raw.Write(append(line, '\n')); err != nil {
			return failed, err
		}
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil {
			fmt.Fprintf(out, "%s\n", line) // not JSON: go's own messages
			continue
		}
		key := e.Package + " " + e.Test
		switch {
		case e.Action == "build-output":
			fmt.Fprint(out, e.Output)
		case e.Action == "build-fail":
			failed = true
		case e.Test == "" && e.Action == "output":
			if e.Output != "PASS\n" && !framing(e.Output) {
				fmt.Fprint(out, e.Output)
			}
		case e.Test == "" && e.Action == "fail":
			failed = true
		case e.Action == "output":
			buffered[key] = append(buffered[key], e.Output)
		case e.Action == "fail":
			failed = true
			for _, l := range buffered[key] {
				if !framing(l) || strings.HasPrefix(strings.TrimSpace(l), "--- FAIL") {
					fmt.Fprint(out, l)
				}
			}
			delete(buffered, key)
		case e.Action == "pass" || e.Action == "skip":
			delete(buffered, key)
		}
	}
	return failed, sc.Err()
}

// framing is a line go test -v adds around a test's own output.
func framing(l string) bool {
	t := strings.TrimSpace(l)
	return strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- ")
}

// Skip is one skipped test.
type Skip struct {
	Source string // the file's name without extension: go-race, pytest, make
	Name   string // package and test, pytest node id, make step
	Reason string
	// PassedIn names the other Go streams in which the same test passed.
	PassedIn []string
}

// NeedsRoot says whether the skip is of a test that needs root.
func (s Skip) NeedsRoot() bool {
	return strings.HasPrefix(strings.ToLower(strings.TrimSpace(s.Reason)), RootPrefix)
}

// collect reads every record of skips in dir.
func collect(dir string) ([]Skip, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var skips []Skip
	passed := map[string][]string{} // Go test key -> sources where it passed
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		source := strings.TrimSuffix(e.Name(), filepath.Ext(e.Name()))
		var got []Skip
		var err error
		switch filepath.Ext(e.Name()) {
		case ".json":
			var pass []string
			got, pass, err = goSkips(path, source)
			for _, k := range pass {
				passed[k] = append(passed[k], source)
			}
		case ".xml":
			got, err = junitSkips(path, source)
		case ".skip":
			got, err = plainSkips(path, source)
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		skips = append(skips, got...)
	}
	for i := range skips {
		skips[i].PassedIn = passed[skips[i].Name]
	}
	sort.SliceStable(skips, func(i, j int) bool {
		if skips[i].Source != skips[j].Source {
			return skips[i].Source < skips[j].Source
		}
		return skips[i].Name < skips[j].Name
	})
	return skips, nil
}

// goSkips reads a go test -json stream: the skipped tests with their
// reasons, and the keys of the tests that passed.
func goSkips(path, source string) ([]Skip, []string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	output := map[string][]string{}
	var skips []Skip
	var passed []string
	for sc.Scan() {
		var e event
		if json.Unmarshal(sc.Bytes(), &e) != nil || e.Test == "" {
			continue
		}
		name := strings.TrimPrefix(e.Package, modulePrefix) + " " + e.Test
		switch e.Action {
		case "output":
			output[name] = append(output[name], e.Output)
		case "skip":
			skips = append(skips, Skip{Source: source, Name: name, Reason: goReason(output[name])})
			delete(output, name)
		case "pass":
			passed = append(passed, name)
			delete(output, name)
		case "fail":
			delete(output, name)
		}
	}
	return skips, passed, sc.Err()
}

// logLine is how testing prints t.Log and t.Skip text: "    file.go:12: text".
var logLine = regexp.MustCompile(`^\s+[\w./-]+\.go:\d+: `)

// goReason is the skip message in a skipped test's output: its last log
// line (t.Skip logs last) with any continuation lines.
func goReason(lines []string) string {
	var body []string
	for _, l := range lines {
		if !framing(l) {
			body = append(body, strings.TrimRight(l, "\n"))
		}
	}
	last := -1
	for i, l := range body {
		if logLine.MatchString(l) {
			last = i
		}
	}
	if last < 0 {
		if len(body) == 0 {
			return "(no reason given)"
		}
		last = 0
	}
	parts := []string{logLine.ReplaceAllString(body[last], "")}
	for _, l := range body[last+1:] {
		parts = append(parts, strings.TrimSpace(l))
	}
	return strings.TrimSpace(strings.Join(parts, " "))
}

// junitSkips reads pytest's --junitxml report.
func junitSkips(path, source string) ([]Skip, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc struct {
		Cases []struct {
			Class   string `xml:"classname,attr"`
			Name    string `xml:"name,attr"`
			Skipped *struct {
				Type    string `xml:"type,attr"`
				Message string `xml:"message,attr"`
				Text    string `xml:",chardata"`
			} `xml:"skipped"`
		} `xml:"testsuite>testcase"`
	}
	if err := xml.Unmarshal(b, &doc); err != nil {
		return nil, err
	}
	var skips []Skip
	for _, c := range doc.Cases {
		if c.Skipped == nil {
			continue
		}
		reason := strings.TrimSpace(c.Skipped.Message)
		if reason == "" {
			reason = strings.TrimSpace(c.Skipped.Text)
		}
		if c.Skipped.Type == "pytest.xfail" {
			reason = "expected to fail (xfail): " + reason
		}
		skips = append(skips, Skip{Source: source, Name: c.Class + "::" + c.Name, Reason: reason})
	}
	return skips, nil
}

// plainSkips reads lines "NAME<TAB>REASON".
func plainSkips(path, source string) ([]Skip, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var skips []Skip
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if strings.TrimSpace(l) == "" {
			continue
		}
		name, reason, ok := strings.Cut(l, "\t")
		if !ok {
			return nil, errors.New("want lines NAME<TAB>REASON, got " + fmt.Sprintf("%q", l))
		}
		skips = append(skips, Skip{Source: source, Name: name, Reason: strings.TrimSpace(reason)})
	}
	return skips, nil
}

// report prints the skips and says whether one of them fails the run: a
// test that needs root, skipped while running as root.
func report(w io.Writer, skips []Skip, asRoot bool) bool {
	if len(skips) == 0 {
		fmt.Fprintln(w, "skipped tests: none")
		return false
	}
	fmt.Fprintf(w, "skipped tests (%d):\n", len(skips))
	bad := false
	for _, s := range skips {
		note := ""
		if len(s.PassedIn) > 0 {
			note = " [passed in " + strings.Join(s.PassedIn, ", ") + "]"
		}
		mark := " "
		if asRoot && s.NeedsRoot() {
			mark, bad = "!", true
		}
		fmt.Fprintf(w, " %s %-10s %s: %s%s\n", mark, s.Source, s.Name, s.Reason, note)
	}
	if bad {
		fmt.Fprintln(w, "FAIL: tests marked ! need root and were skipped although this run is root: they must run (fix what stopped them)")
	}
	return bad
}
