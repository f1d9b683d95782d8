// Package safetext makes text that came from a node or a dump fit for the
// place a person reads it. Node names, service names and kube-proxy's chain
// names are tame, but a node's collector, a rule comment or a cluster dump
// given to `proxyaudit diff` can carry anything: terminal escape sequences
// (a retitled terminal, a hidden line, a disguised hyperlink), bidirectional
// overrides that reorder what is shown (Trojan Source, CVE-2021-42574),
// Slack control sequences (<!channel>, <https://evil|a harmless label>),
// Markdown that breaks a table or makes a link.
//
// Clean is for the boundary where text enters (the stream); the others are
// for one sink each and are applied where that sink is written.
package safetext

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// dangerous reports the runes no sink shows as themselves: control
// characters (C0, DEL, C1: terminal escapes start with ESC or CSI) and the
// invisible format characters that reorder or hide text.
func dangerous(r rune) bool {
	if unicode.IsControl(r) {
		return true
	}
	switch {
	case r >= 0x202A && r <= 0x202E, // LRE, RLE, PDF, LRO, RLO
		r >= 0x2066 && r <= 0x2069,            // LRI, RLI, FSI, PDI
		r == 0x200E, r == 0x200F, r == 0x061C, // LRM, RLM, ALM
		r == 0xFEFF: // BOM / zero-width no-break space
		return true
	}
	return false
}

// Clean replaces invalid UTF-8 and dangerous runes (newlines and tabs
// included) with U+FFFD and cuts s at max bytes on a rune boundary, with
// "…" when cut. It is for text entering from a node: one line, bounded.
func Clean(s string, max int) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.Map(func(r rune) rune {
		if dangerous(r) {
			return unicode.ReplacementChar
		}
		return r
	}, s)
	return Clip(s, max)
}

// Clip cuts s at max bytes without splitting a rune, with "…" when cut.
func Clip(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// Terminal shows dangerous runes and invalid bytes as Go escapes (\x1b,
// \u202e, \xff), so a terminal neither obeys nor hides them; newlines and
// tabs, which the CLI's own tables use, stay.
func Terminal(s string) string {
	return escape(s, func(r rune) bool { return r != '\n' && r != '\t' && dangerous(r) })
}

func escape(s string, bad func(rune) bool) string {
	clean := true
	for i, r := range s {
		if (r == utf8.RuneError && !validAt(s, i)) || bad(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case bad(r) && r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		case bad(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// validAt reports whether the U+FFFD decoded at s[i] is really written
// there (three bytes), not an invalid byte.
func validAt(s string, i int) bool {
	_, n := utf8.DecodeRuneInString(s[i:])
	return n == 3
}

// slackText: Slack reads &, < and > as its control characters (mentions
// such as <!channel>, links <url|label>); its documentation asks for
// exactly these three to be escaped.
var slackText = strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;")

// Slack makes s safe inside a Slack message's text or mrkdwn: no
// mentions, no links with a label of their own, no control characters.
// Slack's own formatting (*bold*, `code`) may still apply, which changes
// how text looks, never what a click does or whom it pages.
func Slack(s string) string {
	return slackText.Replace(escape(s, func(r rune) bool { return r != '\n' && dangerous(r) }))
}

// markdownText escapes what would change a Markdown table cell's
// structure or meaning: the cell's end (|), code, emphasis, links and
// images ([ ]), raw HTML (< >, &), strikethrough (~) and the escape
// character itself. A newline would end the table row.
var markdownText = strings.NewReplacer(
	`\`, `\\`, "`", "\\`", "*", `\*`, "_", `\_`, "[", `\[`, "]", `\]`,
	"<", `\<`, ">", `\>`, "&", `\&`, "|", `\|`, "~", `\~`, "\n", " ", "\r", " ")

// Markdown makes s one inert Markdown table cell (or list item).
func Markdown(s string) string {
	return markdownText.Replace(escape(s, func(r rune) bool { return r != '\n' && r != '\r' && dangerous(r) }))
}
