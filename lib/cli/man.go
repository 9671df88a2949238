package cli

import (
	"fmt"
	"sort"
	"strings"

	"github.com/alecthomas/kong"
)

// Man renders the roff man page (section 1) of a tool from its kong model and
// its Tool description. The output is deterministic, so a checked-in page can
// be compared with a fresh one.
func Man(tool Tool, app *kong.Application) string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w(".TH %s 1 \"\" \"gpubridge\" \"gpubridge manual\"\n", strings.ToUpper(tool.Name))
	w(".SH NAME\n%s \\- %s\n", tool.Name, roff(tool.Summary))

	w(".SH SYNOPSIS\n")
	cmds := leafCommands(app.Node)
	if len(cmds) == 0 {
		w(".B %s\n%s\n.br\n", tool.Name, roff(synopsisArgs(app.Node)))
	}
	for _, c := range cmds {
		w(".B %s\n%s\n.br\n", roff(tool.Name+" "+c.Path()), roff(synopsisArgs(c)))
	}

	if tool.Description != "" {
		w(".SH DESCRIPTION\n")
		paragraphs(&b, tool.Description)
	}

	if len(cmds) > 0 {
		w(".SH COMMANDS\n")
		for _, c := range cmds {
			w(".SS %s\n", roff(c.Path()))
			detail := c.Help
			if c.Detail != "" {
				detail = c.Detail
			}
			paragraphs(&b, detail)
			for _, p := range c.Positional {
				w(".TP\n\\fI%s\\fR\n%s\n", roff(p.Summary()), roff(p.Help))
			}
			writeFlags(&b, ownFlags(c))
		}
	}

	w(".SH OPTIONS\n")
	writeFlags(&b, ownFlags(app.Node))

	if envs := allEnvs(app.Node); len(envs) > 0 {
		w(".SH ENVIRONMENT\n")
		for _, e := range envs {
			w(".TP\n.B %s\n%s\n", roff(e.name), roff(e.help))
		}
		w(".TP\n.B GPUBRIDGE_LOG_LEVEL\nLevel of the log lines on stderr: debug, info, warn or error (default info).\n")
	}

	if tool.Output != "" {
		w(".SH OUTPUT\n")
		paragraphs(&b, tool.Output)
	}

	w(".SH EXIT STATUS\n")
	codes := tool.ExitCodes
	if len(codes) == 0 {
		codes = StandardExitCodes
	}
	for _, c := range codes {
		w(".TP\n.B %d\n%s\n", c.Code, roff(c.Meaning))
	}

	if len(tool.Examples) > 0 {
		w(".SH EXAMPLES\n")
		for _, e := range tool.Examples {
			w(".PP\n%s\n.PP\n.RS 4\n.nf\n%s\n.fi\n.RE\n", roff(e.Text), roff(e.Command))
		}
	}
	if len(tool.SeeAlso) > 0 {
		refs := make([]string, len(tool.SeeAlso))
		for i, s := range tool.SeeAlso {
			refs[i] = "\\fB" + roff(s) + "\\fR(1)"
		}
		w(".SH SEE ALSO\n%s\n", strings.Join(refs, ", "))
	}
	return b.String()
}

func paragraphs(b *strings.Builder, text string) {
	for _, p := range strings.Split(strings.TrimSpace(text), "\n\n") {
		if strings.TrimSpace(p) == "" {
			continue
		}
		fmt.Fprintf(b, ".PP\n%s\n", roff(strings.TrimSpace(p)))
	}
}

func leafCommands(n *kong.Node) []*kong.Node {
	var out []*kong.Node
	for _, c := range n.Children {
		if c.Hidden || c.Type != kong.CommandNode {
			continue
		}
		if c.Leaf() {
			out = append(out, c)
		} else {
			out = append(out, leafCommands(c)...)
		}
	}
	return out
}

func ownFlags(n *kong.Node) []*kong.Flag {
	var out []*kong.Flag
	for _, f := range n.Flags {
		if !f.Hidden {
			out = append(out, f)
		}
	}
	return out
}

func synopsisArgs(n *kong.Node) string {
	var parts []string
	if len(ownFlags(n)) > 0 || n.Parent != nil {
		parts = append(parts, "[flags]")
	}
	for _, p := range n.Positional {
		parts = append(parts, p.Summary())
	}
	return strings.Join(parts, " ")
}

func writeFlags(b *strings.Builder, flags []*kong.Flag) {
	for _, f := range flags {
		head := "\\fB\\-\\-" + roff(f.Name) + "\\fR"
		if f.Short != 0 {
			head = "\\fB-" + string(f.Short) + "\\fR, " + head
		}
		if !f.IsBool() && !f.IsCounter() {
			ph := f.FormatPlaceHolder()
			head += "=\\fI" + roff(ph) + "\\fR"
		}
		help := f.Help
		if f.Enum != "" && !strings.Contains(help, f.Enum) {
			help += " One of: " + f.Enum + "."
		}
		if f.HasDefault && f.Default != "" {
			help += " Default: " + f.Default + "."
		}
		if len(f.Envs) > 0 {
			help += " Environment: " + strings.Join(f.Envs, ", ") + "."
		}
		fmt.Fprintf(b, ".TP\n%s\n%s\n", head, roff(strings.TrimSpace(help)))
	}
}

type envDoc struct{ name, help string }

func allEnvs(n *kong.Node) []envDoc {
	seen := map[string]envDoc{}
	var walk func(n *kong.Node)
	walk = func(n *kong.Node) {
		for _, f := range n.Flags {
			for _, e := range f.Envs {
				if _, ok := seen[e]; !ok {
					seen[e] = envDoc{e, "Default for --" + f.Name + ": " + f.Help}
				}
			}
		}
		for _, c := range n.Children {
			walk(c)
		}
	}
	walk(n)
	out := make([]envDoc, 0, len(seen))
	for _, e := range seen {
		out = append(out, e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// roff escapes text for roff: backslashes, and leading dots or quotes.
func roff(s string) string {
	s = strings.ReplaceAll(s, "\\", "\\e")
	s = strings.ReplaceAll(s, "-", "\\-")
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "'") {
			lines[i] = "\\&" + l
		}
	}
	return strings.Join(lines, "\n")
}
