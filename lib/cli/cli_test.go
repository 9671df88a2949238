package cli

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type greetCmd struct {
	Name  string `arg:"" help:"Who to greet."`
	Loud  bool   `help:"Shout." env:"GREET_LOUD"`
	Times int    `default:"1" help:"How often."`
}

func (g *greetCmd) Run(env *Env) error {
	switch g.Name {
	case "fail":
		return Failed(errors.New("verdict failed"))
	case "broken":
		return errors.New("plain error")
	case "quiet":
		return Silent(ExitFail)
	}
	for i := 0; i < g.Times; i++ {
		_, _ = env.Stdout.Write([]byte("hello " + g.Name + "\n"))
	}
	return nil
}

type grammar struct {
	Greet greetCmd `cmd:"" help:"Greet someone."`
}

var testTool = Tool{
	Name: "gbtest", Summary: "a test tool", Description: "First paragraph.\n\nSecond -paragraph.",
	Examples: []Example{{Command: "gbtest greet --loud bob", Text: "Greets bob."}},
	SeeAlso:  []string{"gbprobe"},
}

func run(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Run(context.Background(), testTool, &grammar{}, args, strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

func TestRunExitCodes(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		code     int
		stdout   string
		stderrIn string
	}{
		{"ok", []string{"greet", "--times=2", "ann"}, ExitOK, "hello ann\nhello ann\n", ""},
		{"verdict", []string{"greet", "fail"}, ExitFail, "", "gbtest: error: verdict failed"},
		{"plain error is could-not-run", []string{"greet", "broken"}, ExitUsage, "", "gbtest: error: plain error"},
		{"silent", []string{"greet", "quiet"}, ExitFail, "", ""},
		{"bad flag", []string{"greet", "--nope", "x"}, ExitUsage, "", "unknown flag --nope"},
		{"missing arg", []string{"greet"}, ExitUsage, "", "expected \"<name>\""},
		{"version", []string{"--version"}, ExitOK, "gbtest " + Version, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errs := run(t, tc.args...)
			assert.Equal(t, tc.code, code, "stderr: %s", errs)
			if tc.stdout != "" {
				assert.Contains(t, out, tc.stdout)
			} else {
				assert.Empty(t, out)
			}
			if tc.stderrIn != "" {
				assert.Contains(t, errs, tc.stderrIn)
			} else if tc.code != ExitUsage {
				assert.NotContains(t, errs, "error")
			}
		})
	}
}

func TestMan(t *testing.T) {
	code, out, _ := run(t, "--man")
	require.Equal(t, ExitOK, code)
	for _, want := range []string{
		".TH GBTEST 1", ".SH NAME\ngbtest \\- a test tool", ".SS greet", "\\fB\\-\\-loud\\fR",
		"Environment: GREET_LOUD.", "Default: 1.", ".SH EXIT STATUS\n.TP\n.B 0", ".SH EXAMPLES",
		"Second \\-paragraph.", "\\fBgbprobe\\fR(1)",
	} {
		assert.Contains(t, out, want)
	}
	_, again, _ := run(t, "--man")
	assert.Equal(t, out, again, "man output must be deterministic")
}

func TestCodeOf(t *testing.T) {
	assert.Equal(t, ExitOK, CodeOf(nil))
	assert.Equal(t, ExitFail, CodeOf(Failed(errors.New("x"))))
	assert.Equal(t, 7, CodeOf(WithCode(7, errors.New("x"))))
	assert.Equal(t, ExitUsage, CodeOf(errors.New("x")))
	assert.Nil(t, WithCode(3, nil))
}
