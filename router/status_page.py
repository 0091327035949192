"""``GET /debug``: the router's state as one self-contained HTML page for people.

The page has no server-side data and no external resource (inline CSS and JavaScript, no CDN,
no build step): it fetches ``debug/index`` (relative, so it also works behind a path prefix)
every few seconds and renders it. Per engine it shows the row ``kvrouter status`` prints
(``engine_rows`` of ``/debug/index``, built by :func:`router.status.rows`) with the reason an
engine is down, degraded or unverified and its resident blocks per group and medium; then the
predicted hit rate per minute (an inline SVG chart) and the last routing decisions
(``recent`` of ``/debug/index``, kept by :class:`router.recorder.Recorder`).

Data is put into the page with ``textContent`` only, never as markup: worker URLs, reasons and
request ids come from workers and clients.
"""

from __future__ import annotations

__all__ = ["PAGE", "REFRESH_S"]

REFRESH_S = 3

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvrouter status</title>
<style>
:root { --bg:#f6f7f9; --card:#fff; --ink:#1d2330; --mute:#6b7385; --line:#e3e6ec;
        --ok:#1a7f37; --warn:#9a6700; --bad:#cf222e; --accent:#2f6fdb; }
* { box-sizing: border-box; }
body { margin:0; font:13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       background:var(--bg); color:var(--ink); }
header { display:flex; flex-wrap:wrap; gap:18px; align-items:baseline; padding:14px 20px;
         background:var(--ink); color:#fff; }
header h1 { font-size:17px; margin:0; letter-spacing:.3px; }
header .kv { color:#c8cfdc; }
header .kv b { color:#fff; font-weight:600; }
#error { display:none; margin:12px 20px 0; padding:8px 12px; border-radius:6px;
         background:#ffebe9; color:var(--bad); border:1px solid #ffcecb; }
main { padding:12px 20px 24px; display:grid; gap:14px; }
section { background:var(--card); border:1px solid var(--line); border-radius:8px;
          padding:12px 14px; }
h2 { font-size:13px; margin:0 0 8px; text-transform:uppercase; letter-spacing:.6px;
     color:var(--mute); }
table { border-collapse:collapse; width:100%; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line);
         vertical-align:top; }
th { font-weight:600; color:var(--mute); font-size:12px; white-space:nowrap; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
td.url { font-family:ui-monospace, Menlo, Consolas, monospace; white-space:nowrap; }
td.reason { color:var(--mute); max-width:420px; }
.badge { display:inline-block; padding:1px 7px; border-radius:10px; font-size:12px;
         font-weight:600; }
.ok { background:#dafbe1; color:var(--ok); }
.warn { background:#fff8c5; color:var(--warn); }
.bad { background:#ffebe9; color:var(--bad); }
.mute { color:var(--mute); }
#chart { width:100%; height:150px; display:block; }
#chart .bar { fill:var(--accent); }
#chart .axis { stroke:var(--line); }
#chart text { fill:var(--mute); font-size:10px; }
.empty { color:var(--mute); padding:6px 8px; }
</style>
</head>
<body data-refreshes="0">
<header>
  <h1>kvrouter</h1>
  <span class="kv">policy <b id="policy">-</b></span>
  <span class="kv">workers <b id="workers">-</b></span>
  <span class="kv">resident blocks <b id="blocks">-</b></span>
  <span class="kv">shared state <b id="shared">-</b></span>
  <span class="kv">up <b id="uptime">-</b></span>
  <span class="kv">updated <b id="updated">never</b></span>
</header>
<div id="error"></div>
<main>
<section>
  <h2>Engines (worker, DP rank)</h2>
  <table id="engines">
    <thead><tr>
      <th>worker</th><th class="num">dp</th><th>health</th><th>events</th><th>trust</th>
      <th class="num">exact / samples</th><th>resident blocks (group/medium)</th>
      <th class="num">in flight</th><th class="num">queued prefill</th><th>reason</th>
    </tr></thead>
    <tbody></tbody>
  </table>
</section>
<section>
  <h2>Predicted hit rate per minute <span class="mute" id="hitnow"></span></h2>
  <svg id="chart" viewBox="0 0 600 150" role="img"
       aria-label="predicted hit tokens / prompt tokens per minute"></svg>
</section>
<section>
  <h2>Last routing decisions</h2>
  <table id="decisions">
    <thead><tr>
      <th>time</th><th>request id</th><th>worker</th><th class="num">dp</th>
      <th class="num">predicted hit / prompt</th><th>reason</th>
    </tr></thead>
    <tbody></tbody>
  </table>
</section>
</main>
<script>
"use strict";
const REFRESH_MS = __REFRESH_S__ * 1000;
const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function badge(text, good, warn) {
  return el("span", text, "badge " + (good ? "ok" : warn ? "warn" : "bad"));
}
function duration(s) {
  s = Math.floor(s || 0);
  if (s < 120) return s + " s";
  if (s < 7200) return Math.floor(s / 60) + " min";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function renderEngines(rows) {
  const body = $("engines").tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    const tr = el("tr"); const td = el("td", "no workers", "empty");
    td.colSpan = 10; tr.append(td); body.append(tr); return;
  }
  for (const r of rows) {
    const tr = el("tr", null, "engine");
    tr.dataset.worker = r.worker; tr.dataset.dp = r.dp;
    const health = r.health === "ok" ? badge("ok", true) : badge("down", false);
    const events = badge(r.events, r.events === "live",
                         r.events === "replaying" || r.events === "pending" || r.events === "none");
    const trust = badge(r.trust.startsWith("UNVERIFIED") ? "unverified" : r.trust,
                        r.trust === "verified", r.trust === "unmeasured");
    const cells = [
      el("td", r.worker, "url"), el("td", r.dp, "num"), el("td"), el("td"), el("td"),
      el("td", r.exact, "num"), el("td", r.resident || "-"), el("td", r["in flight"], "num"),
      el("td", r.queued, "num"), el("td", r.reason || "", "reason"),
    ];
    cells[2].append(health); cells[3].append(events); cells[4].append(trust);
    tr.append(...cells);
    body.append(tr);
  }
}

function renderChart(minutes) {
  const svg = $("chart");
  const ns = "http://www.w3.org/2000/svg";
  // Drawn at the element's own width: a stretched viewBox would distort the labels.
  const W = Math.max(svg.clientWidth || 600, 300), H = 150, top = 8, bottom = 18, left = 34;
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  svg.replaceChildren();
  const mk = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e); return e;
  };
  const h = H - top - bottom;
  for (const f of [0, 0.5, 1]) {
    const y = top + h * (1 - f);
    mk("line", {x1: left, x2: W, y1: y, y2: y, class: "axis"});
    mk("text", {x: 2, y: y + 3}, Math.round(f * 100) + "%");
  }
  const n = Math.max(minutes.length, 1), slot = (W - left) / n;
  minutes.forEach((m, i) => {
    if (m.hit_rate === null) return;
    const bh = Math.max(h * m.hit_rate, 1);
    const bar = mk("rect", {x: left + i * slot + 1, y: top + h - bh,
                            width: Math.max(slot - 2, 1), height: bh, class: "bar"});
    const t = document.createElementNS(ns, "title");
    t.textContent = clock(m.minute) + ": " + (m.hit_rate * 100).toFixed(1) + "% of " +
      m.prompt_tokens + " prompt tokens, " + m.requests + " requests";
    bar.append(t);
  });
  if (minutes.length) {
    mk("text", {x: left, y: H - 4}, clock(minutes[0].minute));
    mk("text", {x: W - 48, y: H - 4}, "now");
  }
  const last = minutes.filter((m) => m.hit_rate !== null).pop();
  $("hitnow").textContent =
    last ? "(latest " + (last.hit_rate * 100).toFixed(1) + "%)" : "(no traffic yet)";
}

function renderDecisions(decisions) {
  const body = $("decisions").tBodies[0];
  body.replaceChildren();
  if (!decisions.length) {
    const tr = el("tr"); const td = el("td", "no request routed yet", "empty");
    td.colSpan = 6; tr.append(td); body.append(tr); return;
  }
  for (const d of decisions) {
    const tr = el("tr", null, "decision");
    tr.dataset.worker = d.worker;
    const pct = d.prompt_tokens
      ? " (" + Math.round((100 * d.predicted_hit_tokens) / d.prompt_tokens) + "%)" : "";
    tr.append(el("td", clock(d.time)), el("td", d.request_id || "-", "url"),
              el("td", d.worker, "url"), el("td", d.dp_rank, "num"),
              el("td", d.predicted_hit_tokens + " / " + d.prompt_tokens + pct, "num"),
              el("td", d.reason, "reason"));
    body.append(tr);
  }
}

function render(doc) {
  const t = doc.totals || {};
  $("policy").textContent = doc.policy || "?";
  $("workers").textContent = (t.healthy_workers || 0) + "/" + (t.workers || 0) + " healthy";
  $("blocks").textContent = t.resident_blocks || 0;
  $("shared").textContent = (doc.shared_state || {}).backend || "local";
  $("uptime").textContent = duration(doc.uptime_s);
  renderEngines(doc.engine_rows || []);
  const recent = doc.recent || {};
  renderChart(recent.hit_rate_per_minute || []);
  renderDecisions(recent.decisions || []);
}

async function refresh() {
  const err = $("error");
  try {
    const r = await fetch("debug/index", {cache: "no-store", credentials: "same-origin"});
    if (!r.ok) throw new Error("debug/index answered " + r.status);
    render(await r.json());
    err.style.display = "none";
    $("updated").textContent = new Date().toLocaleTimeString();
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1);
  } catch (e) {
    err.textContent = "cannot read the router's state: " + e.message;
    err.style.display = "block";
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
""".replace("__REFRESH_S__", str(REFRESH_S))
