// Refreshes the page's live part every 10 s without losing the scroll
// position or the open details; stops when the tab is hidden.
(function () {
  "use strict";
  function open() {
    return Array.from(document.querySelectorAll("details[open] > summary")).map(function (s) { return s.textContent; });
  }
  function refresh() {
    if (document.hidden) { return; }
    fetch(location.href, { credentials: "same-origin", cache: "no-store" }).then(function (r) {
      if (!r.ok) { throw new Error(r.status); }
      return r.text();
    }).then(function (html) {
      var doc = new DOMParser().parseFromString(html, "text/html");
      var keep = open();
      ["live", "freshness"].forEach(function (id) {
        var now = document.getElementById(id), next = doc.getElementById(id);
        if (now && next) { now.replaceWith(next); }
      });
      document.querySelectorAll("details > summary").forEach(function (s) {
        if (keep.indexOf(s.textContent) >= 0) { s.parentElement.open = true; }
      });
    }).catch(function () {
      var f = document.getElementById("freshness");
      if (f) { f.classList.add("bad"); }
    });
  }
  setInterval(refresh, 10000);
})();
