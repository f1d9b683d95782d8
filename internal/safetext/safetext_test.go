package safetext

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// hostile is text a compromised node or a crafted dump could put in a
// chain name, a comment or a read error.
const hostile = "KUBE-SVC-X\x1b]0;pwned\x07\x1b[2K\rns/ok:80 in sync\u202egnp.exe\x9b31m <!channel> <https://evil.example|kubernetes.io> | *x* [a](javascript:alert(1)) `c` \xff end"

func TestTerminalShowsEscapesInsteadOfObeyingThem(t *testing.T) {
	got := Terminal(hostile + "\n\tnext")
	for _, bad := range []string{"\x1b", "\x07", "\r", "\u202e", "\u009b", "\xff"} {
		if strings.Contains(got, bad) {
			t.Errorf("Terminal kept %q: %q", bad, got)
		}
	}
	for _, shown := range []string{`\x1b]0;pwned\x07`, `\x1b[2K\x0d`, `\u202e`, `\x9b`, `\xff end`, "\n\tnext"} {
		if !strings.Contains(got, shown) {
			t.Errorf("Terminal does not show %q: %q", shown, got)
		}
	}
	if plain := "node-a  StaleEndpoint  matrix/web:http  198.18.0.1:8080 (café)"; Terminal(plain) != plain {
		t.Errorf("plain text changed: %q", Terminal(plain))
	}
}

func TestSlackNeitherPagesNorLinks(t *testing.T) {
	got := Slack(hostile)
	for _, bad := range []string{"<!channel>", "<https://", "\x1b", "\u202e", "\xff"} {
		if strings.Contains(got, bad) {
			t.Errorf("Slack kept %q: %q", bad, got)
		}
	}
	for _, shown := range []string{"&lt;!channel&gt;", "&lt;https://evil.example|kubernetes.io&gt;"} {
		if !strings.Contains(got, shown) {
			t.Errorf("Slack does not show %q: %q", shown, got)
		}
	}
	if got := Slack("a & b"); got != "a &amp; b" {
		t.Errorf("Slack(a & b) = %q", got)
	}
}

// unescaped is markdown with every backslash escape pair removed: what
// Markdown would read as syntax.
func unescaped(m string) string {
	var b strings.Builder
	for i := 0; i < len(m); i++ {
		if m[i] == '\\' {
			i++
			continue
		}
		b.WriteByte(m[i])
	}
	return b.String()
}

func TestMarkdownCellStaysOneInertCell(t *testing.T) {
	got := Markdown(hostile + "\nsecond line")
	if syntax := unescaped(got); strings.ContainsAny(syntax, "|[]<>`*_~&\n\x1b\u202e") {
		t.Errorf("Markdown left syntax %q in %q", syntax, got)
	}
	if want := `\[a\](javascript:alert(1))`; !strings.Contains(got, want) {
		t.Errorf("the link is not inert: %q", got)
	}
	if want := `\\x1b\]0;pwned`; !strings.Contains(got, want) {
		t.Errorf("the escape is not shown: %q", got)
	}
}

func TestCleanIsOneBoundedLine(t *testing.T) {
	got := Clean("read failed:\n\x1b[31mfake\u202e"+strings.Repeat("é", 600)+"\xff", 64)
	if len(got) > 64+len("…") || !utf8.ValidString(got) || strings.ContainsAny(got, "\n\x1b\u202e") {
		t.Errorf("Clean: %q (%d bytes)", got, len(got))
	}
	if Clip("ééé", 3) != "é…" {
		t.Errorf("Clip cut inside a rune: %q", Clip("ééé", 3))
	}
}

func FuzzSinks(f *testing.F) {
	f.Add(hostile)
	f.Fuzz(func(t *testing.T, s string) {
		for name, out := range map[string]string{"terminal": Terminal(s), "slack": Slack(s), "markdown": Markdown(s), "clean": Clean(s, 100)} {
			if !utf8.ValidString(out) {
				t.Fatalf("%s: invalid UTF-8 out of %q", name, s)
			}
			for _, r := range out {
				if dangerous(r) && !(r == '\n' && (name == "terminal" || name == "slack")) && !(r == '\t' && name == "terminal") {
					t.Fatalf("%s kept %U out of %q", name, r, s)
				}
			}
		}
		if syntax := unescaped(Markdown(s)); strings.ContainsAny(syntax, "|[]<>`*_~&\n") {
			t.Fatalf("markdown: syntax %q left out of %q", syntax, s)
		}
		if sl := Slack(s); strings.ContainsAny(sl, "<>") {
			t.Fatalf("slack: a bare < or > out of %q", s)
		}
	})
}
