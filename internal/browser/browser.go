// Package browser drives a real headless Chromium (Debian's chromium
// package) for the status page's tests, through the DevTools protocol
// (chromedp). Only tests import it.
package browser

import (
	"context"
	"encoding/base64"
	"html"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// New starts a headless Chromium for t and returns a context that drives
// it; it ends with the test. Without Chromium the test is skipped, or
// fails where end-to-end tests are required (PROXYAUDIT_E2E_REQUIRE, as
// in CI: deploy/install-deps.sh installs it).
func New(t testing.TB) context.Context {
	t.Helper()
	path := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		if os.Getenv("PROXYAUDIT_E2E_REQUIRE") != "" {
			t.Fatal("no Chromium to drive (deploy/install-deps.sh installs Debian's chromium)")
		}
		t.Skip("no Chromium (apt-get install chromium)")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.WindowSize(1400, 1000), chromedp.UserDataDir(t.TempDir()))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	// The first run starts the browser, which lives as long as ctx: no
	// timeout on it (one on an action ends the browser).
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting %s: %v", path, err)
	}
	return ctx
}

// Do runs a step (navigate, wait, click) within a minute: a step that
// hangs fails the test instead of holding it.
func Do(t testing.TB, ctx context.Context, what string, step chromedp.Action[chromedp.Void]) {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := chromedp.Do(c, step); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// Text evaluates a JavaScript expression of string value in the page (a
// Promise of one is awaited).
func Text(t testing.TB, ctx context.Context, js string) string {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	v, err := chromedp.Run(c, chromedp.Evaluate[string](js, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatalf("%s: %v", js, err)
	}
	return v
}

// Screenshot saves the whole page as name.png in the test's artifact
// directory (go test -artifacts keeps it) and says where.
func Screenshot(t testing.TB, ctx context.Context, name string) { shot(t, ctx, name, false) }

// Picture is Screenshot for the README: saved also as name.png under
// $PROXYAUDIT_SCREENSHOTS (`make screenshots` sets it to docs/screenshots)
// when that is set.
func Picture(t testing.TB, ctx context.Context, name string) { shot(t, ctx, name, true) }

func shot(t testing.TB, ctx context.Context, name string, readme bool) {
	t.Helper()
	// Quality 100 is a PNG (below, a JPEG).
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Errorf("screenshot %s: %v", name, err)
		return
	}
	keep(t, name, png, readme)
}

// Terminal shows text as a terminal 120 columns wide prints it, under the
// command that printed it, and keeps its picture as Picture does: how a
// CLI's output looks, for the README.
func Terminal(t testing.TB, ctx context.Context, name, command, text string) {
	t.Helper()
	page := `<!doctype html><meta charset="utf-8"><style>
body { margin: 0; background: #fff; }
pre { display: inline-block; margin: 0; padding: 14px 18px; background: #1d1f21; color: #d8d8d8;
      font: 13px/1.35 "DejaVu Sans Mono", "Liberation Mono", monospace;
      width: 120ch; white-space: pre-wrap; overflow-wrap: anywhere; }
.cmd { color: #8fbf6f; }
</style><pre id="term"><span class="cmd">$ ` + html.EscapeString(command) + "</span>\n" + html.EscapeString(text) + `</pre>`
	Do(t, ctx, "the terminal page", chromedp.Navigate("data:text/html;base64,"+base64.StdEncoding.EncodeToString([]byte(page))))
	c, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(c, chromedp.Screenshot(chromedp.CSS("#term")))
	if err != nil {
		t.Errorf("screenshot %s: %v", name, err)
		return
	}
	keep(t, name, png, true)
}

// keep saves png in the test's artifact directory and, for the README,
// under $PROXYAUDIT_SCREENSHOTS when that is set.
func keep(t testing.TB, name string, png []byte, readme bool) {
	t.Helper()
	dir := t.TempDir()
	if a, ok := t.(interface{ ArtifactDir() string }); ok {
		dir = a.ArtifactDir()
	}
	save(t, dir, name, png)
	if d := os.Getenv("PROXYAUDIT_SCREENSHOTS"); readme && d != "" {
		save(t, d, name, png)
	}
}

func save(t testing.TB, dir, name string, png []byte) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Errorf("screenshot %s: %v", name, err)
		return
	}
	p := filepath.Join(dir, name+".png")
	if err := os.WriteFile(p, png, 0o644); err != nil {
		t.Errorf("screenshot %s: %v", name, err)
		return
	}
	t.Logf("screenshot: %s (%d bytes)", p, len(png))
}
