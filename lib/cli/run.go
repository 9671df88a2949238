package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/alecthomas/kong"
)

// Tool describes a command-line tool beyond what its kong grammar says: the
// man page and --help draw on it.
type Tool struct {
	Name        string
	Summary     string // one line, for the NAME section
	Description string // paragraphs separated by blank lines
	Output      string // what stdout carries and its schema
	ExitCodes   []ExitCode
	Examples    []Example
	SeeAlso     []string
	// Vars are the values of ${name} in the grammar's tags (as kong.Vars),
	// for lists the tool takes from a library (gbbridge's transports):
	// the flag, its help and its man page then follow the library.
	Vars map[string]string
}

// ExitCode documents one exit status.
type ExitCode struct {
	Code    int
	Meaning string
}

// Example documents one command line.
type Example struct {
	Command string
	Text    string
}

// StandardExitCodes are the codes every tool uses.
var StandardExitCodes = []ExitCode{
	{ExitOK, "success: the command ran and every check passed"},
	{ExitFail, "the command ran and its check or verdict failed (the reasons are on stderr and in the JSON)"},
	{ExitUsage, "the command could not run: bad usage, unreadable input, I/O or setup error"},
}

// Env is bound into every command's Run method.
type Env struct {
	Ctx    context.Context
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	Log    *slog.Logger
	Tool   Tool
}

// extras are the flags every tool has.
type extras struct {
	Version kong.VersionFlag `help:"Print the version and exit."`
	Man     manFlag          `hidden:"" help:"Print the man page (roff) and exit."`
}

type manFlag bool

func (manFlag) BeforeReset(app *kong.Kong, tool Tool) error {
	_, err := io.WriteString(app.Stdout, Man(tool, app.Model))
	if err != nil {
		return err
	}
	app.Exit(ExitOK)
	return nil
}

type exitPanic int

// Main runs the tool with the process's arguments and streams and exits.
func Main(tool Tool, grammar any) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := Run(ctx, tool, grammar, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Run parses args into grammar, runs the selected command and returns the
// exit code. It never calls os.Exit, so tests can call it in-process.
func Run(ctx context.Context, tool Tool, grammar any, args []string, stdin io.Reader, stdout, stderr io.Writer) (code int) {
	log := NewLogger(stderr, tool.Name)
	env := &Env{Ctx: ctx, Stdin: stdin, Stdout: stdout, Stderr: stderr, Log: log, Tool: tool}
	defer func() {
		if r := recover(); r != nil {
			if p, ok := r.(exitPanic); ok {
				code = int(p)
				return
			}
			panic(r)
		}
	}()
	parser, err := kong.New(grammar,
		kong.Name(tool.Name),
		kong.Description(tool.Summary),
		kong.Writers(stdout, stderr),
		kong.Exit(func(c int) { panic(exitPanic(c)) }),
		kong.Embed(&extras{}),
		kong.Vars(tool.Vars),
		kong.Vars{"version": VersionString(tool.Name)},
		kong.Bind(tool, env),
		kong.UsageOnError(),
		kong.ConfigureHelp(kong.HelpOptions{Compact: true}),
	)
	if err != nil {
		fmt.Fprintf(stderr, "%s: internal error: %v\n", tool.Name, err)
		return ExitUsage
	}
	kctx, err := parser.Parse(args)
	if err != nil {
		fmt.Fprintf(stderr, "%s: error: %v\n", tool.Name, err)
		return ExitUsage
	}
	err = kctx.Run()
	if err == nil {
		return ExitOK
	}
	var ee *ExitError
	if !errors.As(err, &ee) || ee.Err != nil {
		fmt.Fprintf(stderr, "%s: error: %v\n", tool.Name, err)
	}
	return CodeOf(err)
}

// NewLogger returns the stderr logger tools use. GPUBRIDGE_LOG_LEVEL sets the
// level (debug, info, warn, error; default info).
func NewLogger(w io.Writer, tool string) *slog.Logger {
	var level slog.Level
	if err := level.UnmarshalText([]byte(os.Getenv("GPUBRIDGE_LOG_LEVEL"))); err != nil {
		level = slog.LevelInfo
	}
	h := slog.NewTextHandler(w, &slog.HandlerOptions{Level: level, ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey && len(groups) == 0 {
			return slog.Attr{}
		}
		return a
	}})
	return slog.New(h).With("tool", tool)
}

// IsTerminal reports whether w is a terminal (progress goes to stderr only then).
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
