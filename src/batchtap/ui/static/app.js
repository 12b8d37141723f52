// batchtap ui: the runs table, a run's page and the comparison, drawn with BokehJS.
//
// Written by hand, not minified. Every name, value and message from the store is put into the page
// as text: textContent, DOM nodes built here (the hover tooltips too: a function that builds them,
// never a template Bokeh would parse as HTML), or Bokeh's canvas text (titles, axes). The server
// sends each chart line decimated to the chart's width in pixels (min and max per bucket) and sends
// full detail again when a chart is zoomed in; a running run's new points arrive as server-sent events.
"use strict";

const bt = (window.bt = { charts: {}, ready: false, updates: 0, lastUpdate: null, longTasks: [] });
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22"];
const EVENT_STYLE = {
  anomaly: { marker: "x", color: "#d62728" },
  action: { marker: "inverted_triangle", color: "#9467bd" },
  skip: { marker: "diamond", color: "#ff7f0e" },
  warning: { marker: "square", color: "#8c564b" },
  info: { marker: "circle", color: "#6b7385" },
};
const OUTLIER_COLOR = "#d62728";

// ---- small helpers ---------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child); // strings become text nodes
  return node;
}

async function api(path) {
  // A run page's first reads were started by early.js, before BokehJS loaded: take those.
  const early = window.btEarly && window.btEarly.take(path);
  const response = await (early || fetch(path, { credentials: "same-origin" }));
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function fmtValue(x) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return typeof x === "object" ? JSON.stringify(x) : String(x);
  return number(x);
}

function fmtDuration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  if (s < 60) return `${s.toFixed(1)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

const pad2 = (n) => String(n).padStart(2, "0");
const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");
function fmtShortTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  return `${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
}
const statusBadge = (status) => el("span", { class: `status status-${status}`, text: status });
const shortId = (run) => run.short_id || String(run.id).slice(0, 8);

function setMain(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes.filter((n) => n != null));
  return main;
}

function kvTable(obj) {
  const rows = Object.entries(obj || {}).map(([k, v]) =>
    el("tr", {}, el("td", { text: k }), el("td", { text: v !== null && typeof v === "object" ? JSON.stringify(v) : String(v) })),
  );
  return rows.length ? el("table", { class: "kv" }, el("tbody", {}, ...rows)) : el("p", { class: "muted", text: "none" });
}

function download(name, blob) {
  const link = el("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

// A file name made of a user string: letters, digits and a few marks only.
const fileName = (text) => String(text).replace(/[^A-Za-z0-9._-]+/g, "_").slice(0, 80) || "chart";

function csvCell(value) {
  if (value === null || value === undefined) return "";
  let text = typeof value === "number" ? (Number.isFinite(value) ? String(value) : "") : String(value);
  // A spreadsheet runs a cell that starts with = + - @ as a formula: a name is kept as text.
  if (typeof value === "string" && /^[=+\-@\t\r]/.test(text)) text = `'${text}`;
  return /[",\n\r]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}

// ---- choices kept between pages (x axis, smoothing, all layers): the browser's localStorage -------
const PREFS_KEY = "batchtap.prefs";
function pref(name, fallback) {
  try {
    const all = JSON.parse(localStorage.getItem(PREFS_KEY) || "{}");
    return Object.prototype.hasOwnProperty.call(all, name) ? all[name] : fallback;
  } catch (e) {
    return fallback; // storage off (a private window): the defaults
  }
}
function setPref(name, value) {
  try {
    const all = JSON.parse(localStorage.getItem(PREFS_KEY) || "{}");
    all[name] = value;
    localStorage.setItem(PREFS_KEY, JSON.stringify(all));
  } catch (e) { /* not kept: the choice still holds on this page */ }
}

// ---- units: the console's table (batchtap/_units.py), sent in the page --------------------------
const UNITS = (() => {
  const node = document.getElementById("bt-units");
  try {
    return node ? JSON.parse(node.textContent) : null;
  } catch (e) {
    return null;
  }
})() || { rules: [], mib: 1048576, gib: 1073741824 };

function unitOf(name) {
  for (const [how, text, kind] of UNITS.rules) {
    if ((how === "exact" && name === text) || (how === "prefix" && name.startsWith(text)) ||
        (how === "suffix" && name.endsWith(text)) || (how === "contains" && name.includes(text))) return kind;
  }
  return "plain";
}

// Python's format(v, f".{d}f"): like toFixed, but a value exactly halfway rounds to even
// (15.625 -> "15.62", where toFixed gives "15.63"), so the page and the console print the same.
function fixed(v, d) {
  const long = Math.abs(v).toFixed(Math.min(100, d + 40));
  const cut = long.indexOf(".") + 1 + d;
  if (!/^50*$/.test(long.slice(cut))) return v.toFixed(d);
  const kept = long.slice(0, cut).replace(/\.$/, "");
  const last = Number(kept[kept.length - 1]);
  const down = last % 2 === 0; // already even: drop the half
  const magnitude = down ? kept : (Number(kept) + 10 ** -d).toFixed(d);
  return `${v < 0 ? "-" : ""}${down ? Number(magnitude).toFixed(d) : magnitude}`;
}

// Python's format(v, f".{p}g"): p significant digits, exponent form outside [1e-4, 10**p),
// trailing zeros dropped.
function gFormat(v, p) {
  const [mantissa, exp] = v.toExponential(p - 1).split("e");
  const e = Number(exp);
  const strip = (t) => (t.includes(".") ? t.replace(/0+$/, "").replace(/\.$/, "") : t);
  if (e >= -4 && e < p) return strip(fixed(v, Math.max(0, p - 1 - e)));
  return `${strip(mantissa)}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
}

function number(v, decimals) {
  // batchtap._units.number: fixed in [1e-3, 1e5), else 2 significant digits.
  if (v === null || v === undefined) return "–";
  if (Number.isNaN(v)) return "nan";
  if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e-3 && a < 1e5) return decimals !== undefined ? fixed(v, decimals) : gFormat(v, 4);
  return gFormat(v, 2);
}

// One value with its unit, as the console prints it (batchtap._units.format_value).
function fmtUnit(name, v) {
  if (v === null || v === undefined) return "–";
  if (Number.isNaN(v)) return "nan";
  if (!Number.isFinite(v)) return number(v);
  switch (unitOf(name)) {
    case "fraction": return v >= 0 && v <= 1 ? `${fixed(v * 100, 2)}%` : number(v, 2);
    case "seconds": return v >= 0 && v < 1 ? `${fixed(v * 1e3, 2)}ms` : `${number(v, 2)}s`;
    case "bytes": return Math.abs(v) >= 10 * UNITS.gib ? `${number(v / UNITS.gib, 1)}GiB` : `${fixed(v / UNITS.mib, 0)}MiB`;
    case "percent": return `${number(v, 0)}%`;
    case "per_second": return `${number(v, 0)}/s`;
    case "ratio": return `${number(v, 2)}x`;
    case "watts": return `${number(v, 0)}W`;
    case "celsius": return `${number(v, 0)}C`;
    case "mhz": return `${number(v, 0)}MHz`;
    case "count": return number(v, 0);
    case "loss": return number(v, 4);
    default: return number(v);
  }
}

// How a chart of `name` shows its values: multiply by `scale`, say `suffix` on the axis.
function displayUnit(name, values) {
  const finite = values.filter(Number.isFinite);
  const max = finite.length ? Math.max(...finite.map(Math.abs)) : 0;
  switch (unitOf(name)) {
    case "fraction": return finite.every((v) => v >= 0 && v <= 1) ? { scale: 100, suffix: "%" } : { scale: 1, suffix: "" };
    case "seconds": {
      // milliseconds unless the typical (median) value is a second or more
      const sorted = finite.slice().sort((a, b) => a - b);
      const median = sorted.length ? sorted[Math.floor((sorted.length - 1) / 2)] : 0;
      return median < 1 ? { scale: 1000, suffix: "ms" } : { scale: 1, suffix: "s" };
    }
    case "bytes": return max >= 10 * UNITS.gib ? { scale: 1 / UNITS.gib, suffix: "GiB" } : { scale: 1 / UNITS.mib, suffix: "MiB" };
    case "percent": return { scale: 1, suffix: "%" };
    case "per_second":
      // a FLOP rate in TFLOP/s (GFLOP/s below 1e12: a CPU), tokens as tokens/s
      if (name === "flops_per_second") return max >= 1e12 ? { scale: 1e-12, suffix: "TFLOP/s" } : { scale: 1e-9, suffix: "GFLOP/s" };
      return { scale: 1, suffix: name === "tokens_per_second" ? "tokens/s" : "/s" };
    case "ratio": return { scale: 1, suffix: "x" };
    case "watts": return { scale: 1, suffix: "W" };
    case "celsius": return { scale: 1, suffix: "C" };
    case "mhz": return { scale: 1, suffix: "MHz" };
    default: return { scale: 1, suffix: "" };
  }
}

// ---- an outlier-robust y range -----------------------------------------------------------------
// The bulk of the values is the 5th to 95th percentile (by rank, so a few spikes among few points
// are not interpolated into it); a value more than twice the bulk's own span beyond it is an
// outlier: it is marked at the chart's edge instead of stretching the axis (a 1e31 spike would
// flatten the curve). TensorBoard's "ignore outliers in chart scaling" cuts at the same quantiles.
function robustBounds(sorted) {
  const n = sorted.length;
  const q05 = sorted[Math.ceil(0.05 * (n - 1))];
  const q95 = sorted[Math.floor(0.95 * (n - 1))];
  const span = Math.max(q95 - q05, Math.abs(q95) * 1e-3, Math.abs(q05) * 1e-3, 1e-12);
  return { lo: q05 - 2 * span, hi: q95 + 2 * span };
}

function robustRange(values, log) {
  let v = values.filter(Number.isFinite);
  if (log) v = v.filter((x) => x > 0).map(Math.log10);
  if (!v.length) return null;
  v.sort((a, b) => a - b);
  const { lo, hi } = robustBounds(v);
  const inside = v.filter((x) => x >= lo && x <= hi);
  let start = inside.length ? inside[0] : v[0];
  let end = inside.length ? inside[inside.length - 1] : v[v.length - 1];
  if (end === start) {
    const d = log ? 0.5 : Math.max(Math.abs(end) * 0.05, 1e-9);
    start -= d;
    end += d;
  }
  const padding = (end - start) * 0.06;
  start -= padding;
  end += padding;
  const back = (x) => (log ? 10 ** x : x);
  return { start: back(start), end: back(end), clipped: v.length - inside.length };
}

// ---- charts ------------------------------------------------------------------------------------
function ema(values, weight, prev = null, cut = null) {
  // TensorBoard's smoothing: an exponential moving average that skips gaps (NaN, null), and here
  // outliers too (outside `cut`): one 1e8 spike would otherwise lift the smoothed line off the
  // chart for dozens of steps. The line goes on through them at its last value.
  const out = new Array(values.length);
  let last = prev;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null || !Number.isFinite(v)) { out[i] = NaN; continue; }
    if (cut && (v < cut.lo || v > cut.hi)) { out[i] = last === null ? NaN : last; continue; }
    last = last === null ? v : last * weight + (1 - weight) * v;
    out[i] = last;
  }
  return out;
}

function smoothing() {
  const input = document.getElementById("smoothing");
  return input ? Number(input.value) : 0.6;
}

function smoothingControl(onChange) {
  const kept = Number(pref("smoothing", 0.6));
  const start = Number.isFinite(kept) && kept >= 0 && kept <= 0.99 ? kept : 0.6;
  const input = el("input", { type: "range", id: "smoothing", min: "0", max: "0.99", step: "0.01", value: String(start) });
  const shown = el("span", { text: start.toFixed(2) });
  input.addEventListener("input", () => { shown.textContent = Number(input.value).toFixed(2); setPref("smoothing", Number(input.value)); onChange(); });
  return el("label", {}, "smoothing ", input, " ", shown);
}

// The x axis: step, wall time or epoch; the choice is kept for the next page. `allowEpochs` is
// called once the runs' epochs have arrived (/api/runs/{id}/epochs): epoch is offered when every
// run shown has them, and a kept "epoch" is taken then.
function xControl(onChange, { epochs }) {
  const epochOption = el("option", { value: "epoch", text: "x: epoch" });
  const select = el("select", { id: "xaxis", "aria-label": "x axis" },
    el("option", { value: "step", text: "x: step" }),
    el("option", { value: "wall", text: "x: wall time (s since start)" }),
    epochOption,
  );
  select.allowEpochs = (ok) => {
    epochOption.disabled = !ok;
    select.title = ok ? "" : "no epoch stored for every run shown";
    const kept = pref("x", "step");
    select.value = ["step", "wall", "epoch"].includes(kept) && (kept !== "epoch" || ok) ? kept : "step";
  };
  select.allowEpochs(epochs);
  select.addEventListener("change", () => { setPref("x", select.value); onChange(select.value); });
  return select;
}

const X_LABELS = { step: "step", wall: "seconds since the run started", epoch: "epoch" };

// The x of each step in the chosen mode: the step, seconds since the run started, or the epoch
// with its fraction (from the run's epoch boundaries, [[epoch, first step, last step], ...]).
function xOf(mode, run, steps, walls) {
  if (mode === "wall") return walls.map((w) => w - run.started_at);
  if (mode === "epoch" && Array.isArray(run.epochs) && run.epochs.length) {
    const spans = run.epochs;
    return steps.map((s) => {
      let lo = 0, hi = spans.length - 1, at = 0;
      while (lo <= hi) { const mid = (lo + hi) >> 1; if (spans[mid][1] <= s) { at = mid; lo = mid + 1; } else hi = mid - 1; }
      const [epoch, first, last] = spans[at];
      return epoch + Math.max(0, s - first) / Math.max(1, last - first + 1);
    });
  }
  return steps.slice();
}

function columnsOf(series, unit) {
  // Bokeh columns from the server's; null values become NaN (a gap in the line). Raw points come
  // without lo, hi and mean: they are the step and the value. `stored` keeps the stored value
  // (what the CSV and the tooltip give), `value` the shown one (in the chart's unit).
  const nan = (a) => a.map((v) => (v === null || v === undefined ? NaN : v));
  const stored = nan(series.value);
  const meanStored = series.mean ? nan(series.mean) : stored;
  return {
    x: series.step.slice(), step: series.step.slice(),
    lo: (series.lo || series.step).slice(), hi: (series.hi || series.step).slice(),
    stored, value: stored.map((v) => v * unit.scale), mean: meanStored.map((v) => v * unit.scale),
    wall: series.wall.slice(), smooth: [],
  };
}

function tipTable(rows) {
  // The hover tooltip: built as DOM nodes, every user string a text node.
  const table = el("table", { style: "border-collapse:collapse;font:12px system-ui,sans-serif" });
  for (const [label, value] of rows) {
    table.append(el("tr", {}, el("td", { style: "color:#6b7385;padding:0 6px 0 0", text: label }), el("td", { style: "max-width:28em;white-space:normal;word-break:break-word", text: String(value) })));
  }
  return el("div", {}, table);
}

// Where a run's events are drawn: anomalies of the chart's metric; actions, skips and warnings on
// every step chart (a rule's stop or rollback concerns the whole run). A rollback's bookkeeping
// (the decisions about the abandoned trajectory it ignored, the batches it skipped) is in the
// story's details in the events table, not drawn.
// Notes (`info`: an accumulation noticed, an assumption made) are no degradation: they are listed in
// the events table, not drawn.
function eventsFor(events, metric, sparse) {
  return events.filter((e) => {
    if (e.kind === "anomaly") return e.metric === metric;
    if (sparse || e.kind === "info") return false;
    return !(e.kind === "action" && (/^ignored .* a rollback abandoned/.test(e.message) || /^rollback \d+: skipped batches/.test(e.message)));
  });
}

// One chart: for each line (a run's metric) its raw line and smoothed line; event markers, action
// spans, outliers marked at the edge; log / linear y; CSV and PNG of what it shows. A family of
// lines (per-layer values: `top`) shows its first `top` lines until "all" is pressed; the hidden
// ones are not even read.
class Chart {
  constructor({ metric, title, lines, xRange, sparse = false, width = 800, xMode = "step", legend = false, log = false, top = null, all = false, yLabel = null }) {
    this.metric = metric; this.sparse = sparse; this.pixels = width; this.xMode = xMode;
    this.title = title; this.log = log; this.unit = null; this.loaded = null; this.yLabel = yLabel || metric;
    this.top = top !== null && lines.length > top ? top : null;
    this.multiRun = new Set(lines.map((l) => l.runId)).size > 1;
    this.plot = Bokeh.Plotting.figure({
      height: 240, sizing_mode: "stretch_width", tools: "xpan,xwheel_zoom,box_zoom,reset",
      x_axis_label: X_LABELS[xMode], toolbar_location: "above", output_backend: "canvas",
      x_range: xRange, y_range: new Bokeh.Range1d({ start: log ? 0.1 : 0, end: 1 }), y_axis_type: log ? "log" : "linear",
    });
    this.plot.toolbar.autohide = true;
    this.lines = lines.map((spec, i) => {
      const color = spec.color || COLORS[i % COLORS.length];
      const source = new Bokeh.ColumnDataSource({ data: { x: [], step: [], lo: [], hi: [], stored: [], value: [], mean: [], wall: [], smooth: [] } });
      const dash = spec.dash || "solid";
      const raw = this.plot.line({ field: "x" }, { field: "value" }, { source, line_color: color, line_alpha: sparse ? 0.8 : 0.3, line_dash: dash });
      const smooth = this.plot.line({ field: "x" }, { field: "smooth" }, { source, line_color: color, line_width: 2, line_dash: dash });
      if (sparse) this.plot.scatter({ field: "x" }, { field: "value" }, { source, size: 6, fill_color: color, line_color: color });
      const hidden = this.top !== null && !all && i >= this.top;
      raw.visible = smooth.visible = !hidden;
      const line = { ...spec, name: spec.metric, color, source, raw, smooth, mode: "raw", lastStep: -Infinity, events: [], hidden };
      this.plot.add_tools(new Bokeh.HoverTool({ renderers: [raw, smooth], mode: "mouse", tooltips: (ds, vars) => this.tip(line, vars.index) }));
      return line;
    });
    this.events = new Bokeh.ColumnDataSource({ data: { x: [], y: [], step: [], kind: [], message: [], marker: [], color: [], run: [] } });
    const marks = this.plot.scatter({ field: "x" }, { field: "y" }, {
      source: this.events, size: 12, marker: { field: "marker" }, line_color: { field: "color" }, fill_color: { field: "color" }, fill_alpha: 0.6, line_width: 2,
    });
    this.plot.add_tools(new Bokeh.HoverTool({ renderers: [marks], tooltips: (ds, vars) => this.eventTip(vars.index) }));
    this.outliers = new Bokeh.ColumnDataSource({ data: { x: [], y: [], step: [], stored: [], run: [], marker: [], metric: [] } });
    const out = this.plot.scatter({ field: "x" }, { field: "y" }, {
      source: this.outliers, size: 11, marker: { field: "marker" }, fill_color: OUTLIER_COLOR, line_color: "#ffffff", line_width: 1,
    });
    this.plot.add_tools(new Bokeh.HoverTool({ renderers: [out], tooltips: (ds, vars) => this.outlierTip(vars.index) }));
    this.spans = [];
    this.node = this.frame(legend);
  }

  // The chart's box: its title, a legend and its controls as HTML above the plot (never over the data).
  frame(legend) {
    this.logBox = el("input", { type: "checkbox", class: "log-toggle", "aria-label": "log scale" });
    this.logBox.checked = this.log;
    this.logBox.addEventListener("change", () => this.setLog(this.logBox.checked));
    this.plotNode = el("div", { class: "plot" });
    this.note = el("div", { class: "clip-note" });
    this.titleNode = el("h3", { text: this.title });
    for (const l of this.lines) l.key = el("li", { style: l.hidden ? "display:none" : undefined }, el("span", { class: "swatch", style: `background:${l.color}` }), l.label);
    const keys = legend ? el("ul", { class: "legend" }, ...this.lines.map((l) => l.key)) : null;
    this.allButton = this.top === null ? null : el("button", {
      type: "button", class: "all-lines", text: this.lines.some((l) => l.hidden) ? `all ${this.lines.length}` : `top ${this.top}`, title: `every line, not only the top ${this.top}`,
      onclick: () => this.showAll(this.lines.some((l) => l.hidden)).catch(showError),
    });
    return el("div", { class: "chart", "data-metric": this.metric },
      el("div", { class: "chart-head" }, this.titleNode,
        el("span", { class: "chart-tools" }, this.allButton,
          el("label", { title: "logarithmic y axis" }, this.logBox, " log"),
          el("button", { type: "button", class: "csv", text: "CSV", title: "the points shown, as CSV", onclick: () => this.csv() }),
          el("button", { type: "button", class: "png", text: "PNG", title: "the chart as a PNG image", onclick: () => this.png().catch(showError) }))),
      keys, this.plotNode, this.note);
  }

  // The lines drawn now (a family's hidden lines are neither read nor counted in the y range).
  shown() {
    return this.lines.filter((l) => !l.hidden);
  }

  // Every line of a family (`on`), or its first `top` again; the choice is kept for the next page.
  async showAll(on, keep = true) {
    if (this.top === null) return;
    if (keep) setPref("allLines", on);
    this.lines.forEach((l, i) => {
      l.hidden = !on && i >= this.top;
      l.raw.visible = l.smooth.visible = !l.hidden;
      l.key.style.display = l.hidden ? "none" : "";
    });
    this.allButton.textContent = on ? `top ${this.top}` : `all ${this.lines.length}`;
    await this.load(...(this.loaded || [null, null]));
  }

  async load(start = null, end = null) {
    const lines = this.shown();
    const all = await Promise.all(lines.map((line) => {
      const params = new URLSearchParams({ metric: line.metric, width: String(this.pixels) });
      if (start !== null) params.set("start", String(Math.floor(start)));
      if (end !== null) params.set("end", String(Math.ceil(end)));
      return api(`/api/runs/${encodeURIComponent(line.runId)}/series?${params}`);
    }));
    if (!this.unit) {
      const values = all.flatMap((s) => s.value.filter((v) => v !== null));
      this.unit = displayUnit(this.metric, values);
      const unitText = this.unit.suffix ? ` (${this.unit.suffix})` : "";
      this.plot.yaxis.axis_label = `${this.yLabel}${unitText}`; // canvas text
    }
    all.forEach((series, i) => this.replace(lines[i], series));
    this.loaded = start === null ? null : [start, end];
    this.fitY();
  }

  replace(line, series) {
    const data = columnsOf(series, this.unit);
    data.x = xOf(this.xMode, line.run, data.step, data.wall);
    data.smooth = ema(data.mean, this.sparse ? 0 : smoothing(), null, this.cut);
    line.mode = series.mode; line.rank = series.rank;
    line.lastStep = Math.max(line.lastStep, data.step.length ? data.step[data.step.length - 1] : -Infinity);
    line.source.data = data;
  }

  append(line, series) {
    const keep = series.step.map((s, i) => (s > line.lastStep ? i : -1)).filter((i) => i >= 0);
    if (!keep.length) return;
    const pick = (a) => keep.map((i) => a[i]);
    const data = columnsOf({ step: pick(series.step), value: pick(series.value), wall: pick(series.wall) }, this.unit);
    data.x = xOf(this.xMode, line.run, data.step, data.wall);
    const prevSmooth = line.source.data.smooth;
    let prev = null;
    for (let i = prevSmooth.length - 1; i >= 0; i--) if (Number.isFinite(prevSmooth[i])) { prev = prevSmooth[i]; break; }
    data.smooth = ema(data.mean, this.sparse ? 0 : smoothing(), prev, this.cut);
    line.lastStep = data.step[data.step.length - 1];
    line.source.stream(data);
  }

  resmooth() {
    if (this.sparse) return;
    for (const line of this.lines) line.source.data = { ...line.source.data, smooth: ema(line.source.data.mean, smoothing(), null, this.cut) };
  }

  // Steps a rollback undid, shaded: the trajectory that was abandoned (its values stay stored and
  // drawn; best values leave them out). Drawn on the step axis only.
  shade(ranges) {
    this.boxes = ranges.map(([first, last]) => new Bokeh.BoxAnnotation({
      left: first - 0.5, right: last + 0.5, fill_color: EVENT_STYLE.action.color, fill_alpha: 0.08, line_alpha: 0,
      visible: this.xMode === "step",
    }));
    for (const box of this.boxes) this.plot.add_layout(box);
  }

  setX(mode) {
    this.xMode = mode;
    for (const box of this.boxes || []) box.visible = mode === "step";
    this.plot.xaxis.axis_label = X_LABELS[mode];
    for (const line of this.lines) {
      const d = line.source.data;
      line.source.data = { ...d, x: xOf(mode, line.run, Array.from(d.step), Array.from(d.wall)) };
    }
    this.placeEvents();
  }

  // The step shown at x (the first line's points, whose x grows with the step).
  stepAt(x) {
    if (this.xMode === "step") return x;
    const d = this.lines[0].source.data;
    const xs = d.x;
    if (!xs.length) return x;
    let lo = 0, hi = xs.length - 1;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (xs[mid] < x) lo = mid + 1; else hi = mid; }
    return d.step[lo];
  }

  // The y range: the bulk of every line's values, outliers marked at the edge (see robustRange).
  fitY() {
    const values = this.shown().flatMap((l) => Array.from(l.source.data.value));
    const finite = values.filter(Number.isFinite).sort((a, b) => a - b);
    const cut = finite.length ? robustBounds(finite) : null;
    const changed = !this.cut || !cut || cut.lo !== this.cut.lo || cut.hi !== this.cut.hi;
    this.cut = cut;
    if (changed) this.resmooth();
    const range = robustRange(values, this.log);
    const y = this.plot.y_range;
    if (range) y.setv({ start: range.start, end: range.end, reset_start: range.start, reset_end: range.end });
    this.range = range;
    const out = { x: [], y: [], step: [], stored: [], run: [], marker: [], metric: [] };
    if (range) {
      for (const line of this.shown()) {
        const d = line.source.data;
        for (let i = 0; i < d.value.length; i++) {
          const v = d.value[i];
          if (!Number.isFinite(v) || (this.log && v <= 0)) continue;
          if (v > range.end || v < range.start) {
            out.x.push(d.x[i]); out.step.push(d.step[i]); out.stored.push(d.stored[i]); out.run.push(line.label); out.metric.push(line.metric);
            out.y.push(v > range.end ? range.end : range.start);
            out.marker.push(v > range.end ? "triangle" : "inverted_triangle");
          }
        }
      }
    }
    this.outliers.data = out;
    if (out.step.length) {
      const worst = out.stored.reduce((a, b) => (Math.abs(b) > Math.abs(a) ? b : a));
      const named = out.metric[out.stored.indexOf(worst)] || this.metric;
      this.note.textContent = `${out.step.length} point${out.step.length === 1 ? "" : "s"} outside the y range, marked ▲ at the edge (largest ${fmtUnit(named, worst)}); box-zoom to see them`;
    } else {
      this.note.textContent = "";
    }
    this.placeEvents();
  }

  setLog(on) {
    if (on === this.log) return;
    this.log = on;
    if (this.logBox.checked !== on) this.logBox.checked = on;
    const label = this.plot.left[0].axis_label;
    this.plot.y_scale = on ? new Bokeh.LogScale() : new Bokeh.LinearScale();
    this.plot.left = [on ? new Bokeh.LogAxis({ axis_label: label }) : new Bokeh.LinearAxis({ axis_label: label })];
    this.fitY();
  }

  setEvents(eventsByRun) {
    // A run's actions, skips and warnings are drawn once per chart: on its first line (the other
    // lines of the same run, step_time's data_time or a family's layers, get their anomalies only).
    const seen = new Set();
    for (const line of this.lines) {
      const own = eventsFor(eventsByRun[line.runId] || [], line.metric, this.sparse);
      line.events = seen.has(line.runId) ? own.filter((e) => e.kind === "anomaly") : own;
      seen.add(line.runId);
    }
    if (this.spans.length) this.plot.center = this.plot.center.filter((a) => !this.spans.includes(a));
    this.spans = [];
    if (this.xMode === "step") {
      for (const line of this.lines) {
        for (const e of line.events) {
          if (e.kind !== "action") continue;
          const span = new Bokeh.Span({ location: e.step, dimension: "height", line_color: line.color, line_dash: "dashed", line_width: 1, line_alpha: 0.6 });
          this.plot.add_layout(span);
          this.spans.push(span);
        }
      }
    }
    this.placeEvents();
  }

  placeEvents() {
    const out = { x: [], y: [], step: [], kind: [], message: [], marker: [], color: [], run: [] };
    for (const line of this.shown()) {
      const d = line.source.data;
      for (const e of line.events) {
        let y = nearestValue(d, e.step);
        if (this.range) y = Math.min(Math.max(y, this.range.start), this.range.end);
        const x = xOf(this.xMode, line.run, [e.step], [e.wall ?? line.run.started_at])[0];
        const style = EVENT_STYLE[e.kind] || EVENT_STYLE.warning;
        out.x.push(x); out.y.push(y); out.step.push(e.step); out.kind.push(e.kind); out.message.push(e.message);
        out.marker.push(style.marker); out.color.push(style.color); out.run.push(line.label);
      }
    }
    this.events.data = out;
  }

  tip(line, i) {
    const d = line.source.data;
    if (i === undefined || i === null || i < 0 || i >= d.step.length) return null;
    const step = d.lo[i] === d.hi[i] ? String(d.step[i]) : `${d.lo[i]}–${d.hi[i]}`;
    const rows = [["metric", line.metric]];
    if (this.multiRun) rows.push(["run", line.label]);
    rows.push(["step", step], [line.mode === "minmax" ? "min/max" : "value", fmtUnit(line.metric, d.stored[i])]);
    if (!this.sparse && Number.isFinite(d.smooth[i])) rows.push(["smoothed", fmtUnit(line.metric, d.smooth[i] / this.unit.scale)]);
    rows.push(["wall time", fmtTime(d.wall[i])]);
    return tipTable(rows);
  }

  eventTip(i) {
    const d = this.events.data;
    if (i === undefined || i === null || i >= d.step.length) return null;
    const rows = [["event", `${d.kind[i]} at step ${d.step[i]}`]];
    if (this.multiRun) rows.push(["run", d.run[i]]);
    rows.push(["message", d.message[i]]);
    return tipTable(rows);
  }

  outlierTip(i) {
    const d = this.outliers.data;
    if (i === undefined || i === null || i >= d.step.length) return null;
    const rows = [["metric", d.metric[i] || this.metric]];
    if (this.multiRun) rows.push(["run", d.run[i]]);
    rows.push(["step", String(d.step[i])], ["value (outside the y range)", fmtUnit(d.metric[i] || this.metric, d.stored[i])]);
    return tipTable(rows);
  }

  // The points this chart shows (stored values, decimated points with the steps they stand for).
  csv() {
    const header = ["run", "run_id", "metric", "step", "first_step", "last_step", "wall_time", "value", "smoothed"];
    const rows = [header.join(",")];
    for (const line of this.shown()) {
      const d = line.source.data;
      for (let i = 0; i < d.step.length; i++) {
        const smooth = Number.isFinite(d.smooth[i]) ? d.smooth[i] / this.unit.scale : null;
        rows.push([line.label, line.runId, line.metric, d.step[i], d.lo[i], d.hi[i], d.wall[i], d.stored[i], smooth].map(csvCell).join(","));
      }
    }
    const text = rows.join("\n") + "\n";
    bt.lastDownload = { kind: "csv", text };
    download(`${fileName(this.lines.length === 1 ? this.lines[0].label : "compare")}-${fileName(this.metric)}.csv`, new Blob([text], { type: "text/csv" }));
  }

  async png() {
    const view = Bokeh.index.get(this.plot);
    if (!view) throw new Error("the chart is not drawn yet");
    const blob = await view.export("png").to_blob();
    bt.lastDownload = { kind: "png", size: blob.size, type: blob.type };
    download(`${fileName(this.lines.length === 1 ? this.lines[0].label : "compare")}-${fileName(this.metric)}.png`, blob);
  }

  // After a zoom or pan: fetch detail when the view shows decimated points, or the whole run again
  // when it leaves the zoomed-in window that was fetched.
  onRange(x0, x1) {
    if (this.sparse) return;
    const s0 = this.stepAt(x0), s1 = this.stepAt(x1);
    const decimated = this.shown().some((l) => l.mode === "minmax");
    const outside = this.loaded && (s0 < this.loaded[0] || s1 > this.loaded[1]);
    if (!decimated && !outside) return;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      const span = s1 - s0;
      this.load(outside && span > 0.5 * (this.fullSpan || span) ? null : s0 - span * 0.25, s1 + span * 0.25)
        .then(() => this.placeEvents()).catch(showError);
    }, 120);
  }
}

function nearestValue(data, step) {
  // The value at or before `step` that is finite (an anomaly's own value is NaN): where its marker sits.
  const steps = data.step;
  let lo = 0, hi = steps.length - 1, at = -1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (steps[mid] <= step) { at = mid; lo = mid + 1; } else hi = mid - 1;
  }
  for (let i = at; i >= 0; i--) if (Number.isFinite(data.value[i])) return data.value[i];
  for (let i = Math.max(at, 0); i < steps.length; i++) if (Number.isFinite(data.value[i])) return data.value[i];
  return 0;
}

// Every chart of a page in one Bokeh document (they share the x range: zoom one, all follow), each
// drawn into its own box below its HTML header.
async function drawCharts(charts, box) {
  if (!charts.length) {
    box.append(el("p", { class: "muted", text: "no values stored yet" }));
    return;
  }
  const grid = el("div", { class: "charts" }, ...charts.map((c) => c.node));
  box.append(grid);
  const doc = new Bokeh.Document();
  for (const chart of charts) doc.add_root(chart.plot);
  await Bokeh.embed.add_document_standalone(doc, grid, charts.map((c) => c.plotNode));
}

function chartColumns() {
  return window.innerWidth >= 1100 ? 2 : 1;
}

// ---- events: one rollback, one story -------------------------------------------------------------
// A rollback writes several events: the anomaly that asked for it, the action (restored snapshot,
// undone steps), the batches it skipped, anomalies still arriving from the abandoned trajectory and
// the decisions about them it ignored. They are shown as one row, the rest under "details".
function stories(events) {
  const out = [];
  const byNumber = new Map();
  const rollbacks = [];
  for (const e of events) {
    const m = e.kind === "action" && /^rollback (\d+): (?!skipped batches)/.exec(e.message);
    if (!m) continue;
    const undone = /undone steps (\d+)\.\.(\d+)/.exec(e.message);
    const from = /divergence at step (\d+)/.exec(e.message);
    const story = {
      kind: "rollback", number: Number(m[1]), action: e, step: from ? Number(from[1]) : e.step,
      first: undone ? Number(undone[1]) : (from ? Number(from[1]) : e.step), last: undone ? Number(undone[2]) : e.step,
      events: [], ignored: 0, anomalies: 0,
    };
    byNumber.set(story.number, story);
    rollbacks.push(story);
  }
  const storyOf = (e) => {
    const skipped = e.kind === "action" && /^rollback (\d+): skipped batches/.exec(e.message);
    if (skipped) return byNumber.get(Number(skipped[1]));
    const ignored = e.kind === "action" && /^ignored .* at step (\d+): a rollback abandoned/.exec(e.message);
    const step = ignored ? Number(ignored[1]) : e.kind === "anomaly" ? e.step : null;
    if (step === null) return byNumber.get(Number((/^rollback (\d+):/.exec(e.message) || [])[1]));
    return rollbacks.find((s) => step >= s.first - 1 && step <= s.last) || (ignored ? rollbacks[rollbacks.length - 1] : undefined);
  };
  for (const e of events) {
    const story = storyOf(e);
    if (!story) { out.push({ kind: e.kind, step: e.step, rank: e.rank, metric: e.metric, raw: e.raw, message: e.message, events: [e] }); continue; }
    story.events.push(e);
    if (e.kind === "anomaly") story.anomalies += 1;
    if (/^ignored /.test(e.message)) story.ignored += 1;
  }
  for (const s of rollbacks) {
    const trigger = s.events.find((e) => e.kind === "anomaly" && e.step === s.step) || s.events.find((e) => e.kind === "anomaly");
    const skipped = s.events.find((e) => /skipped batches/.test(e.message));
    const parts = [s.action.message];
    if (skipped) parts.push(skipped.message.replace(/^rollback \d+: /, ""));
    if (s.ignored) parts.push(`${s.ignored} decision${s.ignored === 1 ? "" : "s"} about the abandoned trajectory ignored`);
    out.push({
      kind: "rollback", step: s.step, rank: s.action.rank, metric: trigger ? trigger.metric : s.action.metric,
      raw: trigger ? trigger.raw : null, message: parts.join("; "), events: s.events,
    });
  }
  return out.sort((a, b) => a.step - b.step);
}

function showEvents(box, events) {
  bt.events = events;
  const eventsByRun = { [bt.run.id]: events };
  for (const chart of Object.values(bt.charts)) chart.setEvents(eventsByRun);
  if (!events.length) { box.replaceChildren(el("p", { class: "muted", text: "no events" })); return; }
  const rows = stories(events);
  bt.stories = rows;
  // Which kinds are listed: a box per kind present, with its count (kept across live updates).
  const hidden = (bt.hiddenKinds = bt.hiddenKinds || new Set());
  const counts = new Map();
  for (const r of rows) counts.set(r.kind, (counts.get(r.kind) || 0) + 1);
  const kinds = [...counts.keys()].sort();
  const columns = [
    { key: "step", label: "step", num: true, render: (e) => String(e.step) },
    { key: "rank", label: "rank", num: true, render: (e) => (e.rank < 0 ? "all" : String(e.rank ?? "")) },
    { key: "kind", label: "kind" },
    { key: "metric", label: "metric" },
    { key: "raw", label: "raw value" },
    {
      key: "message", label: "message", cls: "message", render: (e) => {
        const text = el("span", { class: "message", text: e.message });
        if (e.events.length <= 1) return text;
        const list = el("ul", {}, ...e.events.map((x) => el("li", { text: `step ${x.step} ${x.kind}${x.metric ? ` (${x.metric})` : ""}: ${x.message}` })));
        return el("span", {}, text, el("details", { class: "story" }, el("summary", { text: `${e.events.length} events` }), list));
      },
    },
  ];
  const table = sortableTable(columns, rows.slice(), { id: "events-table" });
  table.keep = (r) => !hidden.has(r.kind);
  table.filter();
  const filters = el("div", { class: "toolbar kinds", id: "event-kinds" }, "show ", ...kinds.map((kind) => {
    const box = el("input", { type: "checkbox", value: kind });
    box.checked = !hidden.has(kind);
    box.addEventListener("change", () => { if (box.checked) hidden.delete(kind); else hidden.add(kind); table.filter(); });
    return el("label", { class: `kind kind-${kind}` }, box, ` ${kind === "info" ? "info (notes)" : kind} (${counts.get(kind)})`);
  }));
  box.replaceChildren(filters, el("div", { class: "tablewrap" }, table));
}

// A sortable table: columns [{key, label, num, render?}], rows of objects.
function sortableTable(columns, rows, { id, sort } = {}) {
  let sortKey = sort ? sort.key : null;
  let sortDir = sort ? sort.dir : 1;
  const tbody = el("tbody");
  const heads = columns.map((c) => el("th", { text: c.label, title: c.title || c.label, onclick: () => sortBy(c.key) }));
  function cell(c, row) {
    const td = el("td", { class: [c.num ? "num" : "", c.cls || ""].join(" ").trim() });
    if (c.render) td.append(c.render(row));
    else td.textContent = c.num ? fmtValue(row[c.key]) : row[c.key] == null ? "–" : fmtValue(row[c.key]);
    return td;
  }
  function draw(list) {
    tbody.replaceChildren(...list.map((row) => el("tr", { "data-id": row.id || "", "data-kind": typeof row.kind === "string" ? row.kind : null }, ...columns.map((c) => cell(c, row)))));
  }
  function order() {
    if (sortKey === null) return;
    rows.sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      if (x == null) return 1;
      if (y == null) return -1;
      return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y))) * sortDir;
    });
  }
  function sortBy(key) {
    sortDir = sortKey === key ? -sortDir : 1;
    sortKey = key;
    heads.forEach((h, i) => (h.className = columns[i].key === key ? (sortDir > 0 ? "sorted-asc" : "sorted-desc") : ""));
    table.filter();
  }
  const table = el("table", id ? { id } : {}, el("thead", {}, el("tr", {}, ...heads)), tbody);
  table.sortState = () => (sortKey === null ? null : { key: sortKey, dir: sortDir });
  heads.forEach((h, i) => (h.className = columns[i].key === sortKey ? (sortDir > 0 ? "sorted-asc" : "sorted-desc") : ""));
  table.keep = () => true;
  table.filter = () => {
    order();
    const shown = rows.filter((r) => table.keep(r));
    draw(shown);
    return shown;
  };
  table.items = rows;
  table.filter();
  return table;
}

// ---- the runs table's query --------------------------------------------------------------------
// `lr<0.01 and status=finished` is matched by the server (`/api/runs?q=`, batchtap/store/runquery.py,
// the same language as `batchtap runs --where`): the page keeps the ids it names. Text without an
// operator is looked for in every column, here.
const QUERY_OPERATOR = /<=|>=|!=|==|=|<|>|~/;

async function queryKeep(text) {
  if (!text) return () => true;
  if (!QUERY_OPERATOR.test(text)) {
    const needle = text.toLowerCase();
    return (r) => r._text.includes(needle);
  }
  const body = await api(`/api/runs?q=${encodeURIComponent(text)}`);
  const ids = new Set(body.runs.map((r) => r.id));
  return (r) => ids.has(r.id);
}

// ---- runs table --------------------------------------------------------------------------------
function runRow(r, configKeys) {
  const row = { ...r, short: shortId(r), tags: Array.isArray(r.tags) ? r.tags : [], notes: r.notes ?? null };
  for (const k of configKeys) row[`config.${k}`] = r.config ? r.config[k] : undefined;
  row._text = [r.id, r.name, r.status, r.main, ...(row.tags || []), row.notes || "", ...configKeys.map((k) => JSON.stringify(row[`config.${k}`] ?? ""))]
    .join(" ").toLowerCase();
  return row;
}

async function runsView() {
  const data = await api("/api/runs");
  document.getElementById("store").textContent = data.store;
  document.title = "batchtap: runs";
  const state = { runs: new Map(data.runs.map((r) => [r.id, r])), skew: data.now ? data.now - Date.now() / 1000 : 0 };
  const selected = new Set();
  const title = el("h1", { id: "runs-count" });
  const filter = el("input", { type: "search", placeholder: "filter: text, or lr<0.01 and status=finished", id: "filter", "aria-label": "filter runs" });
  const queryError = el("span", { id: "query-error", class: "error" });
  const compare = el("button", { type: "button", text: "compare selected", id: "compare" });
  const parallel = el("button", { type: "button", text: "parallel coordinates", id: "parallel-toggle" });
  const parallelBox = el("div", { id: "parallel-box" });
  const wrap = el("div", { class: "tablewrap", id: "runs-wrap" });
  setMain(title, el("div", { class: "toolbar" }, filter, compare, parallel, queryError), wrap, parallelBox);

  let table = null;
  let keep = () => true;
  let shown = [];
  let configKeys = [];
  const build = (redraw = true) => {
    const list = [...state.runs.values()].sort((a, b) => b.started_at - a.started_at || String(a.id).localeCompare(String(b.id)));
    configKeys = [...new Set(list.flatMap((r) => Object.keys(r.config || {})))].sort();
    const rows = list.map((r) => runRow(r, configKeys));
    const hasTags = rows.some((r) => r.tags.length), hasNotes = rows.some((r) => r.notes);
    const unitName = (r) => r.main || "";
    const columns = [
      {
        key: "select", label: "", render: (r) => el("input", {
          type: "checkbox", "aria-label": "select for comparison", checked: selected.has(r.id) ? "checked" : undefined,
          onchange: (e) => { if (e.target.checked) selected.add(r.id); else selected.delete(r.id); update(); },
        }),
      },
      { key: "name", label: "name", cls: "name", render: (r) => el("a", { href: `/run/${encodeURIComponent(r.id)}`, text: r.name, title: `${r.name} (${r.id})` }) },
      { key: "short", label: "id", cls: "id" },
      { key: "status", label: "status", render: (r) => statusBadge(r.status) },
      { key: "started_at", label: "started", render: (r) => el("span", { text: fmtShortTime(r.started_at), title: fmtTime(r.started_at) }) },
      { key: "duration", label: "duration", num: true, render: (r) => el("span", { class: "duration", text: fmtDuration(durationOf(r, state.skew)) }) },
      { key: "steps", label: "steps", num: true },
      { key: "main", label: "metric" },
      { key: "last_value", label: "last", num: true, render: (r) => fmtUnit(unitName(r), r.last_value) },
      { key: "best_value", label: "best", num: true, title: "best on the kept trajectory", render: (r) => fmtUnit(unitName(r), r.best_value) },
      { key: "anomalies", label: "anomalies", num: true },
      ...(hasTags ? [{ key: "tags", label: "tags", render: (r) => el("span", {}, ...r.tags.map((t) => el("span", { class: "tag", text: t }))) }] : []),
      ...(hasNotes ? [{ key: "notes", label: "note", cls: "note", render: (r) => el("span", { text: r.notes || "", title: r.notes || "" }) }] : []),
      ...configKeys.map((k) => ({
        key: `config.${k}`, label: k, title: `config: ${k}`, cls: "config",
        num: rows.every((r) => r[`config.${k}`] == null || typeof r[`config.${k}`] === "number"),
      })),
    ];
    table = sortableTable(columns, rows, { id: "runs", sort: table ? table.sortState() : null });
    table.keep = (r) => keep(r);
    wrap.replaceChildren(table);
    update(redraw);
  };
  const update = (redrawParallel = true) => {
    shown = table.filter();
    const total = state.runs.size;
    title.textContent = shown.length === total ? `${total} run${total === 1 ? "" : "s"}` : `${shown.length} of ${total} runs`;
    const visibleSelected = shown.filter((r) => selected.has(r.id));
    compare.textContent = `compare selected (${visibleSelected.length})`;
    compare.disabled = visibleSelected.length === 0;
    bt.runsShown = shown.map((r) => r.id);
    if (redrawParallel && parallelBox.childElementCount) drawParallel(parallelBox, visibleSelected.length ? visibleSelected : shown, configKeys, visibleSelected.length > 0).catch(showError);
  };
  let asked = 0; // the latest filter text asked for: an older answer arriving later is dropped
  const applyFilter = async () => {
    const mine = ++asked;
    let next;
    let error = "";
    try {
      next = await queryKeep(filter.value.trim());
    } catch (e) {
      next = () => false;
      error = e.message;
    }
    if (mine !== asked) return;
    keep = next;
    queryError.textContent = error;
    update();
  };
  filter.addEventListener("input", () => { applyFilter().catch(showError); });
  compare.addEventListener("click", () => {
    const ids = shown.filter((r) => selected.has(r.id)).map((r) => r.id);
    if (ids.length) location.href = `/compare?runs=${ids.map(encodeURIComponent).join(",")}`;
  });
  parallel.addEventListener("click", () => {
    if (parallelBox.childElementCount) { parallelBox.replaceChildren(); bt.parallel = null; return; }
    parallelBox.append(el("p", { class: "muted", text: "drawing…" }));
    update();
  });
  build();
  markReady();
  followRuns(state, () => {
    build(false);
    // a run that arrived or changed may now match a server-side query: ask again
    if (QUERY_OPERATOR.test(filter.value)) applyFilter().catch(showError);
  }, () => {
    // durations of running runs move every second, between the server's updates
    for (const node of document.querySelectorAll("#runs tr")) {
      const run = state.runs.get(node.dataset.id);
      const cell = node.querySelector(".duration");
      if (run && cell && run.status === "running") cell.textContent = fmtDuration(durationOf(run, state.skew));
    }
  });
}

function durationOf(run, skew = 0) {
  if (run.status === "running") return Math.max(run.duration || 0, Date.now() / 1000 + skew - run.started_at);
  return run.duration;
}

// The runs table stays live: new runs appear, statuses, steps and values move. The server's live
// runs stream when it has one, else the runs list read again every 2 s.
function followRuns(state, rebuild, tick) {
  setInterval(tick, 1000);
  let gotMessage = false;
  const merge = (runs, removed = []) => {
    for (const r of runs) state.runs.set(r.id, r);
    for (const id of removed) state.runs.delete(id);
    bt.runsUpdates = (bt.runsUpdates || 0) + 1;
    rebuild();
  };
  const poll = async () => {
    const data = await api("/api/runs").catch(() => null);
    if (data) {
      if (data.now) state.skew = data.now - Date.now() / 1000;
      const ids = new Set(data.runs.map((r) => r.id));
      merge(data.runs, [...state.runs.keys()].filter((id) => !ids.has(id)));
    }
    setTimeout(poll, 2000);
  };
  if (!window.EventSource) { setTimeout(poll, 2000); return; }
  const source = new EventSource("/api/runs/live");
  bt.runsLive = source;
  source.addEventListener("runs", (message) => {
    gotMessage = true;
    const update = JSON.parse(message.data);
    if (update.now) state.skew = update.now - Date.now() / 1000;
    merge(update.runs || [], update.removed || []);
  });
  source.addEventListener("error", () => {
    if (!gotMessage) { source.close(); bt.runsLive = null; setTimeout(poll, 2000); } // no live stream here: read again
  });
}

// ---- the sweep view: parallel coordinates of config -> metric ------------------------------------
async function drawParallel(box, runs, configKeys, chosen) {
  const metricOf = (r) => r.main || "metric";
  const select = box.querySelector("#pc-metric") || el("select", { id: "pc-metric", "aria-label": "metric axis" },
    el("option", { value: "best_value", text: "best (kept trajectory)" }), el("option", { value: "last_value", text: "final" }));
  if (!select.dataset.bound) {
    select.dataset.bound = "1";
    select.addEventListener("change", () => drawParallel(box, bt.parallelRuns, bt.parallelKeys, bt.parallelChosen).catch(showError));
  }
  bt.parallelRuns = runs; bt.parallelKeys = configKeys; bt.parallelChosen = chosen;
  const metricKey = select.value || "best_value";
  // Axes: the config keys whose values differ among these runs (all when they agree), then the metric.
  const values = (k) => runs.map((r) => (r.config || {})[k]);
  let keys = configKeys.filter((k) => new Set(values(k).map((v) => JSON.stringify(v ?? null))).size > 1);
  if (!keys.length) keys = configKeys.slice();
  const axes = keys.map((k) => {
    const vs = values(k);
    const numeric = vs.every((v) => typeof v === "number"); // a missing value makes it an axis of categories
    if (numeric) {
      const finite = vs.filter(Number.isFinite);
      const lo = Math.min(...finite), hi = Math.max(...finite);
      const positive = finite.length && lo > 0 && hi / lo >= 100; // lr, weight decay: a log axis
      const t = (v) => (positive ? Math.log10(v) : v);
      return { label: k, norm: (v) => (Number.isFinite(v) ? (hi === lo ? 0.5 : (t(v) - t(lo)) / (t(hi) - t(lo))) : NaN), low: fmtValue(lo), high: fmtValue(hi), log: positive };
    }
    const cats = [...new Set(vs.map((v) => JSON.stringify(v ?? null)))].sort();
    const shown = (c) => { const v = JSON.parse(c); return typeof v === "string" ? v : c; };
    return { label: k, norm: (v) => (cats.length === 1 ? 0.5 : cats.indexOf(JSON.stringify(v ?? null)) / (cats.length - 1)), low: shown(cats[0]), high: shown(cats[cats.length - 1]) };
  });
  const mvals = runs.map((r) => r[metricKey]).filter(Number.isFinite);
  const mlo = Math.min(...mvals), mhi = Math.max(...mvals);
  const metricNames = [...new Set(runs.map(metricOf))];
  const mlabel = `${metricKey === "best_value" ? "best" : "final"} ${metricNames.join("/")}`;
  axes.push({ label: mlabel, norm: (v) => (Number.isFinite(v) ? (mhi === mlo ? 0.5 : (v - mlo) / (mhi - mlo)) : NaN), low: fmtUnit(metricNames[0] || "", mlo), high: fmtUnit(metricNames[0] || "", mhi), metric: true });
  const xs = [], ys = [], names = [], colors = [], ids = [], details = [];
  runs.forEach((r) => {
    const row = axes.map((a, i) => a.norm(a.metric ? r[metricKey] : (r.config || {})[keys[i]]));
    xs.push(axes.map((_, i) => i));
    ys.push(row);
    names.push(r.name);
    ids.push(r.id);
    const m = r[metricKey];
    const t = Number.isFinite(m) && mhi > mlo ? (m - mlo) / (mhi - mlo) : 0.5;
    colors.push(gradient(r.higher_is_better ? t : 1 - t));
    details.push(keys.map((k) => [k, fmtValue((r.config || {})[k])]).concat([[mlabel, fmtUnit(metricOf(r), m)]]));
  });
  const source = new Bokeh.ColumnDataSource({ data: { xs, ys, name: names, color: colors, id: ids } });
  const p = Bokeh.Plotting.figure({
    height: 320, sizing_mode: "stretch_width", tools: "", toolbar_location: null,
    x_range: new Bokeh.Range1d({ start: -0.3, end: axes.length - 0.7 }), y_range: new Bokeh.Range1d({ start: -0.12, end: 1.12 }),
  });
  p.yaxis.visible = false;
  p.ygrid.visible = false;
  p.xgrid.visible = false;
  p.xaxis.ticker = new Bokeh.FixedTicker({ ticks: axes.map((_, i) => i) });
  // canvas text; BokehJS takes the overrides as a Map from the tick
  p.xaxis.major_label_overrides = new Map(axes.map((a, i) => [i, a.label + (a.log ? " (log)" : "")]));
  for (const [i, a] of axes.entries()) {
    p.add_layout(new Bokeh.Span({ location: i, dimension: "height", line_color: "#9aa1ad", line_width: 1 }));
    p.add_layout(new Bokeh.Label({ x: i, y: 1.02, text: String(a.high), text_font_size: "11px", text_align: "center", text_color: "#6b7385" }));
    p.add_layout(new Bokeh.Label({ x: i, y: -0.08, text: String(a.low), text_font_size: "11px", text_align: "center", text_color: "#6b7385" }));
  }
  const lines = p.multi_line({ field: "xs" }, { field: "ys" }, { source, line_color: { field: "color" }, line_width: 2.5, line_alpha: 0.85 });
  p.add_tools(new Bokeh.HoverTool({ renderers: [lines], tooltips: (ds, vars) => tipTable([["run", names[vars.index]], ...details[vars.index]]) }));
  const node = el("div", { class: "chart", id: "parallel" });
  box.replaceChildren(
    el("div", { class: "toolbar" }, el("h2", { text: "config → metric" }), select,
      el("span", { class: "muted", text: chosen ? `${runs.length} selected run${runs.length === 1 ? "" : "s"}, one line each` : `no run selected: the ${runs.length} runs shown, one line each` })),
    node,
  );
  bt.parallel = { source, axes: axes.map((a) => a.label), lines: xs.length };
  await Bokeh.Plotting.show(p, node);
}

function gradient(t) {
  // good (1) blue-green, bad (0) red: the metric's colour on the parallel-coordinates view
  const a = [0xd6, 0x27, 0x28], b = [0x1a, 0x9e, 0x77];
  const c = a.map((x, i) => Math.round(x + (b[i] - x) * Math.min(1, Math.max(0, t))));
  return `#${c.map((x) => x.toString(16).padStart(2, "0")).join("")}`;
}

// ---- run page ----------------------------------------------------------------------------------
// Throughput a trainer quotes (metrics/throughput.py), drawn right after the step time.
const THROUGHPUT_TITLES = { mfu: "MFU (model FLOPs utilisation)", flops_per_second: "FLOP/s", tokens_per_second: "tokens/s" };
// Per-layer values (bt.metrics.Layers): one chart per kind, a line per layer.
const LAYER_FAMILY = /^(grad_norm|weight_norm|update_ratio)\/(.+)$/;
const LAYER_TOP = 5;

// The charts' order: the stored order, with the throughput charts moved right after step_time
// (after the main metric when there is no step time) and the per-layer values left out (drawn
// as families, below).
function chartOrder(metrics, main) {
  const order = metrics.filter((m) => !(m in THROUGHPUT_TITLES) && !LAYER_FAMILY.test(m));
  const throughput = Object.keys(THROUGHPUT_TITLES).filter((m) => metrics.includes(m));
  let at = order.indexOf("step_time");
  if (at < 0) at = order.indexOf(main);
  order.splice(at + 1, 0, ...throughput);
  return order;
}

// [kind, [layer, ...]] per family with values, the layers by their latest value, largest first
// (the server's order, /api/runs/{id}/layers), the others after them in stored order.
function layerFamilies(metrics, layers) {
  const families = new Map();
  for (const m of metrics) {
    const found = LAYER_FAMILY.exec(m);
    if (!found) continue;
    if (!families.has(found[1])) families.set(found[1], []);
    families.get(found[1]).push(found[2]);
  }
  const order = (layers && layers.order) || {};
  return [...families].map(([kind, names]) => {
    const ranked = (order[kind] || []).filter((n) => names.includes(n));
    return [kind, [...ranked, ...names.filter((n) => !ranked.includes(n))]];
  });
}

// The step time and the throughput beside it, as a trainer quotes them: each one's median over the
// points read (the stored values, or each bucket's min and max on a long run), in the chart's unit.
function throughputFacts(charts) {
  const parts = [];
  for (const metric of ["step_time", ...Object.keys(THROUGHPUT_TITLES)]) {
    const chart = charts[metric];
    const line = chart && chart.lines.find((l) => l.metric === metric);
    if (!line) continue;
    const values = Array.from(line.source.data.stored).filter(Number.isFinite).sort((a, b) => a - b);
    if (!values.length) continue;
    const median = values[Math.floor((values.length - 1) / 2)];
    const unit = displayUnit(metric, values);
    const shown = median * unit.scale;
    const text = metric === "tokens_per_second" ? Math.round(shown).toLocaleString("en-US") : number(shown, metric === "step_time" ? 2 : undefined);
    parts.push(el("span", { "data-metric": metric }, `${metric === "step_time" ? "step" : THROUGHPUT_TITLES[metric].split(" ")[0]} `, el("b", { text: unit.suffix === "%" || !unit.suffix ? `${text}${unit.suffix}` : `${text} ${unit.suffix}` })));
  }
  return parts.length > 1 ? el("span", { id: "throughput", title: "medians over the points shown" }, "median ", ...parts) : null;
}

async function runView(runId) {
  const run = await api(`/api/runs/${encodeURIComponent(runId)}`);
  document.title = `batchtap: ${run.name}`;
  bt.run = run;
  const status = statusBadge(run.status);
  status.id = "status";
  const facts = el("div", { class: "facts" },
    el("span", {}, "id ", el("b", { text: run.id })),
    el("span", {}, "started ", el("b", { text: fmtTime(run.started_at) })),
    el("span", {}, "duration ", el("b", { id: "duration", text: fmtDuration(durationOf(run)) })),
    el("span", {}, "last step ", el("b", { id: "steps", text: String(run.last_step ?? "–") })),
    el("span", {}, "world size ", el("b", { text: String(run.world_size) })),
    run.stop_reason ? el("span", { id: "stop-reason" }, "stop reason ", el("b", { text: run.stop_reason })) : null,
    Array.isArray(run.tags) && run.tags.length ? el("span", { id: "tags" }, "tags ", ...run.tags.map((t) => el("span", { class: "tag", text: t }))) : null,
  );
  const notes = run.notes ? el("p", { id: "notes", class: "notes", text: run.notes }) : null;
  const chartsBox = el("div", { id: "charts" });
  const eventsBox = el("div", { id: "events" });
  const ranksBox = el("div", { id: "ranks" });
  const xSelect = xControl((mode) => {
    for (const chart of Object.values(bt.charts)) chart.setX(mode);
  }, { epochs: false });
  const epochsPromise = api(`/api/runs/${encodeURIComponent(runId)}/epochs`).catch(() => ({ epochs: [] }));
  const layersPromise = run.metrics.some((m) => LAYER_FAMILY.test(m))
    ? api(`/api/runs/${encodeURIComponent(runId)}/layers`).catch(() => null) : Promise.resolve(null);
  setMain(
    el("h1", { id: "run-name", text: run.name }, " ", status),
    facts, notes,
    el("div", { class: "toolbar" }, smoothingControl(() => Object.values(bt.charts).forEach((c) => c.resmooth())), xSelect,
      el("span", { class: "muted", text: "y: bulk of the values (outliers marked ▲), log per chart" })),
    chartsBox, ranksBox,
    el("h2", { text: "events" }), eventsBox,
    el("h2", { text: "config" }), kvTable(run.config),
    el("h2", { text: "environment" }), kvTable(run.environment),
  );

  if (window.btEarly) await window.btEarly.ready; // early.js has asked for the lines by now
  run.epochs = (await epochsPromise).epochs || [];
  xSelect.allowEpochs(run.epochs.length > 0);
  const xMode = xSelect.value;
  const xRange = new Bokeh.DataRange1d();
  const columns = chartColumns();
  // The width early.js asked the lines for (its reads are then used), else the box's own.
  const width = (window.btEarly && window.btEarly.width) || Math.max(200, Math.floor(chartsBox.clientWidth / columns) - 40);
  const line = (metric, label) => ({ runId: run.id, run, metric, label: label || metric });
  const stepMetrics = run.metrics.filter((m) => !run.sparse.includes(m));
  for (const metric of chartOrder(stepMetrics, run.main)) {
    if (metric === "data_time" && stepMetrics.includes("step_time")) continue; // drawn with step_time
    const withData = metric === "step_time" && stepMetrics.includes("data_time");
    const lines = withData ? [line("step_time", "compute (step_time)"), line("data_time", "data wait (data_time)")] : [line(metric)];
    const title = withData ? "time per step: compute and data wait" : THROUGHPUT_TITLES[metric] || metric;
    bt.charts[metric] = new Chart({ metric, title, lines, xRange, width, legend: withData, xMode });
  }
  const layers = await layersPromise;
  for (const [kind, names] of layerFamilies(stepMetrics, layers)) {
    const lines = names.map((layer) => line(`${kind}/${layer}`, layer));
    const top = Math.min(LAYER_TOP, lines.length);
    bt.charts[`${kind}/*`] = new Chart({
      metric: `${kind}/*`, yLabel: kind, lines, xRange, width, legend: true, xMode, log: true, top: lines.length > top ? top : null, all: Boolean(pref("allLines", false)),
      title: lines.length > top ? `${kind} per layer: top ${top} of ${lines.length} by latest value` : `${kind} per layer`,
    });
  }
  for (const metric of run.sparse) {
    bt.charts[metric] = new Chart({ metric, title: `${metric} (tap.log)`, lines: [line(metric)], xRange, sparse: true, width, xMode });
  }

  const eventsPromise = api(`/api/runs/${encodeURIComponent(runId)}/events`);
  await Promise.all(Object.values(bt.charts).map((chart) => chart.load()));
  const { events } = await eventsPromise;
  showEvents(eventsBox, events);
  const undone = Array.isArray(run.rolled_back) ? run.rolled_back : [];
  for (const chart of Object.values(bt.charts)) if (!chart.sparse) chart.shade(undone);
  await drawCharts(Object.values(bt.charts), chartsBox);
  const throughput = throughputFacts(bt.charts);
  if (throughput) facts.append(throughput);
  for (const chart of Object.values(bt.charts)) chart.fullSpan = Math.max(1, run.last_step ?? 1);
  xRange.connect(xRange.change, () => {
    for (const chart of Object.values(bt.charts)) if (!chart.sparse) chart.onRange(xRange.start, xRange.end);
  });
  markReady();
  const perRank = Object.entries(run.ranks).filter(([, ranks]) => ranks.filter((r) => r >= 0).length > 1);
  if (perRank.length) showRanks(ranksBox, runId, perRank.map(([m]) => m)).catch(showError);
  if (run.status === "running") follow(run, events.length);
}

// The per-rank view (runs with per_rank_rows): per step the slowest rank, the largest and smallest value.
async function showRanks(box, runId, metrics) {
  const metric = metrics.includes("step_time") ? "step_time" : metrics[0];
  const data = await api(`/api/runs/${encodeURIComponent(runId)}/ranks?metric=${encodeURIComponent(metric)}&width=1000`);
  const nan = (a) => a.map((v) => (v === null ? NaN : v));
  const unit = displayUnit(metric, nan(data.max));
  const scaled = (a) => nan(a).map((v) => v * unit.scale);
  const source = new Bokeh.ColumnDataSource({ data: { x: data.step, step: data.step, max: scaled(data.max), min: scaled(data.min), spread: scaled(data.spread), slowest: data.slowest, rawMax: nan(data.max), rawMin: nan(data.min), rawSpread: nan(data.spread) } });
  const p = Bokeh.Plotting.figure({ height: 240, sizing_mode: "stretch_width", tools: "xpan,xwheel_zoom,box_zoom,reset", x_axis_label: "step", toolbar_location: "above" });
  p.title.text = `${metric} across ranks ${data.ranks.join(", ")}`;
  p.yaxis.axis_label = unit.suffix ? `${metric} (${unit.suffix})` : metric;
  const hi = p.line({ field: "x" }, { field: "max" }, { source, line_color: COLORS[3] });
  p.line({ field: "x" }, { field: "min" }, { source, line_color: COLORS[2] });
  p.line({ field: "x" }, { field: "spread" }, { source, line_color: COLORS[7], line_dash: "dashed" });
  const d = source.data;
  p.add_tools(new Bokeh.HoverTool({
    renderers: [hi], tooltips: (ds, vars) => tipTable([["step", String(d.step[vars.index])], ["slowest rank", String(d.slowest[vars.index])],
      ["max", fmtUnit(metric, d.rawMax[vars.index])], ["min", fmtUnit(metric, d.rawMin[vars.index])], ["spread", fmtUnit(metric, d.rawSpread[vars.index])]]),
  }));
  const counts = {};
  for (const r of data.slowest) counts[r] = (counts[r] || 0) + 1;
  const summary = Object.entries(counts).sort((a, b) => b[1] - a[1]).map(([r, n]) => `rank ${r}: ${n}`).join(", ");
  const legend = el("ul", { class: "legend" }, ...[["slowest rank", COLORS[3]], ["fastest rank", COLORS[2]], ["spread (max − min)", COLORS[7]]]
    .map(([label, color]) => el("li", {}, el("span", { class: "swatch", style: `background:${color}` }), label)));
  const node = el("div", { class: "chart", id: "rank-chart" });
  box.replaceChildren(el("h2", { text: "ranks" }), el("p", { class: "muted", text: `slowest rank per step (count): ${summary}` }), legend, node);
  bt.ranks = { source, data };
  await Bokeh.Plotting.show(p, node);
}

// Live: new points, events and the status, pushed by the server while the run runs.
function follow(run, eventsSeen) {
  const after = Math.min(...Object.values(bt.charts).filter((c) => !c.sparse).map((c) => c.lines[0].lastStep).filter(Number.isFinite), Infinity);
  const params = new URLSearchParams({ events: String(eventsSeen) });
  if (Number.isFinite(after)) params.set("after", String(after));
  const source = new EventSource(`/api/runs/${encodeURIComponent(run.id)}/live?${params}`);
  bt.live = source;
  const started = run.started_at;
  const clock = setInterval(() => {
    document.getElementById("duration").textContent = fmtDuration(Date.now() / 1000 - started);
  }, 1000);
  let grew = false;
  source.addEventListener("update", (message) => {
    const update = JSON.parse(message.data);
    for (const [metric, series] of Object.entries(update.lines || {})) {
      for (const chart of Object.values(bt.charts)) {
        const line = chart.lines.find((l) => l.metric === metric);
        if (line) { chart.append(line, series); grew = true; }
      }
    }
    if (update.events) showEvents(document.getElementById("events"), update.events);
    for (const chart of Object.values(bt.charts)) chart.placeEvents();
    if (update.status) setStatus(update.status, update.stop_reason);
    const main = bt.charts[run.main];
    if (main) document.getElementById("steps").textContent = String(main.lines[0].lastStep);
    bt.updates += 1;
    bt.lastUpdate = { at: performance.timeOrigin + performance.now(), lastStep: main ? main.lines[0].lastStep : null };
  });
  // The y range follows the growing lines, at most once a second (a full pass over the points).
  let ticks = 0;
  const refit = setInterval(() => {
    if (!grew) return;
    grew = false;
    for (const chart of Object.values(bt.charts)) chart.fitY();
    // By epoch, the epoch being trained grows: its spans are read again every 5 s while new
    // points arrive, so a new step is placed within its epoch, not past the last known end.
    if ((ticks += 1) % 5 === 0) rereadEpochs();
  }, 1000);
  const rereadEpochs = () => {
    if (document.getElementById("xaxis").value !== "epoch") return;
    api(`/api/runs/${encodeURIComponent(run.id)}/epochs`).then(({ epochs }) => {
      run.epochs = epochs || run.epochs;
      for (const chart of Object.values(bt.charts)) chart.setX("epoch");
      bt.epochsRead = (bt.epochsRead || 0) + 1;
    }).catch(() => {});
  };
  source.addEventListener("end", (message) => {
    source.close();
    clearInterval(clock);
    clearInterval(refit);
    for (const chart of Object.values(bt.charts)) chart.fitY();
    rereadEpochs(); // the last epoch's end is known now
    setStatus(JSON.parse(message.data).status);
    api(`/api/runs/${encodeURIComponent(run.id)}`).then((r) => {
      document.getElementById("duration").textContent = fmtDuration(r.duration);
    }).catch(() => {});
  });
}

function setStatus(status, reason) {
  const badge = document.getElementById("status");
  if (!badge || !status) return;
  badge.textContent = status;
  badge.className = `status status-${status}`;
  if (reason && !document.getElementById("stop-reason")) {
    document.querySelector(".facts").append(el("span", { id: "stop-reason" }, "stop reason ", el("b", { text: reason })));
  }
}

// ---- compare -----------------------------------------------------------------------------------
async function compareView(ids) {
  const runs = await Promise.all(ids.map((id) => api(`/api/runs/${encodeURIComponent(id)}`)));
  const [eventsByRun] = await Promise.all([
    Promise.all(runs.map(async (r) => [r.id, (await api(`/api/runs/${encodeURIComponent(r.id)}/events`)).events])).then(Object.fromEntries),
    Promise.all(runs.map(async (r) => { r.epochs = (await api(`/api/runs/${encodeURIComponent(r.id)}/epochs`).catch(() => ({}))).epochs || []; })),
  ]);
  document.title = `batchtap: compare ${runs.length} runs`;
  const colorOf = (r) => COLORS[runs.indexOf(r) % COLORS.length];
  const labelOf = (r) => `${r.name} (${shortId(r)})`;
  const box = el("div", { id: "charts" });
  const legend = el("ul", { id: "compare-runs", class: "legend" }, ...runs.map((r) => el("li", {},
    el("span", { class: "swatch", style: `background:${colorOf(r)}` }),
    el("a", { href: `/run/${encodeURIComponent(r.id)}`, text: r.name }), ` (${shortId(r)}, `, statusBadge(r.status), ")")));
  const epochs = runs.every((r) => r.epochs.length > 0);
  const align = xControl(() => draw().catch(showError), { epochs });
  align.id = "align";
  const all = [...new Set(runs.flatMap((r) => r.metrics))];
  const metrics = all.filter((m) => !LAYER_FAMILY.test(m));
  // Per-layer values: one chart per kind, a line per layer and run (colour: the layer; the first
  // run solid, the others dashed), the first run's top 5 layers by latest value drawn.
  const withLayers = runs.filter((r) => r.metrics.some((m) => LAYER_FAMILY.test(m)));
  const layerOrder = withLayers.length ? await api(`/api/runs/${encodeURIComponent(withLayers[0].id)}/layers`).catch(() => null) : null;
  const families = layerFamilies(all, layerOrder);
  setMain(el("h1", { text: `compare ${runs.length} run${runs.length === 1 ? "" : "s"}` }), legend,
    el("div", { class: "toolbar" }, smoothingControl(() => Object.values(bt.charts).forEach((c) => c.resmooth())), align,
      el("span", { class: "muted", text: "events of every run marked; y: bulk of the values, log per chart" })), box);
  const draw = async () => {
    bt.ready = false; // drawn again (another x axis): ready once the new charts are
    box.replaceChildren();
    bt.charts = {};
    const xMode = align.value;
    const xRange = new Bokeh.DataRange1d();
    const width = Math.max(200, Math.floor(box.clientWidth / chartColumns()) - 40);
    for (const metric of metrics) {
      const have = runs.filter((r) => r.metrics.includes(metric));
      const sparse = have.every((r) => r.sparse.includes(metric));
      const lines = have.map((r) => ({ runId: r.id, run: r, metric, label: labelOf(r), color: colorOf(r) }));
      bt.charts[metric] = new Chart({ metric, title: metric, lines, xRange, width, xMode, sparse });
    }
    for (const [kind, names] of families) {
      const lines = names.flatMap((layer, i) => runs.filter((r) => r.metrics.includes(`${kind}/${layer}`)).map((r) => ({
        runId: r.id, run: r, metric: `${kind}/${layer}`, label: `${layer} · ${labelOf(r)}`,
        color: COLORS[i % COLORS.length], dash: runs.indexOf(r) > 0 ? "dashed" : undefined, layer,
      })));
      const shownLayers = new Set(names.slice(0, LAYER_TOP));
      const top = lines.filter((l) => shownLayers.has(l.layer)).length;
      bt.charts[`${kind}/*`] = new Chart({
        metric: `${kind}/*`, yLabel: kind, lines, xRange, width, xMode, legend: true, log: true,
        top: lines.length > top ? top : null, all: Boolean(pref("allLines", false)),
        title: names.length > LAYER_TOP ? `${kind} per layer: top ${LAYER_TOP} of ${names.length}` : `${kind} per layer`,
      });
    }
    await Promise.all(Object.values(bt.charts).map((c) => c.load()));
    for (const chart of Object.values(bt.charts)) chart.setEvents(eventsByRun);
    await drawCharts(Object.values(bt.charts), box);
    // compatibility for readers of the old compare page: each chart's sources, one per run
    for (const chart of Object.values(bt.charts)) chart.sources = chart.lines.map((l) => l.source);
    markReady();
  };
  await draw();
}

// ---- start -------------------------------------------------------------------------------------
function markReady() {
  bt.ready = true;
  bt.readyAt = performance.now();
  document.body.dataset.ready = "1";
}

function showError(error) {
  console.error(error);
  document.getElementById("main").append(el("p", { class: "error", id: "error", text: String(error.message || error) }));
}

if ("PerformanceObserver" in window) {
  try {
    new PerformanceObserver((list) => bt.longTasks.push(...list.getEntries().map((e) => e.duration))).observe({ type: "longtask" });
  } catch (e) { /* long task timing is optional */ }
}

function route() {
  const path = location.pathname;
  if (path.startsWith("/run/")) return runView(decodeURIComponent(path.slice(5)));
  if (path === "/compare") {
    const ids = (new URLSearchParams(location.search).get("runs") || "").split(",").filter(Boolean);
    return compareView(ids);
  }
  return runsView();
}

route().catch(showError);
