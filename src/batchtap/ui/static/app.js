// batchtap ui: the runs table, a run's page and the comparison, drawn with BokehJS.
//
// Written by hand, not minified. Every name, value and message from the store is put into the page
// as text (textContent, or Bokeh's own text rendering): never as HTML. The server sends each chart
// line decimated to the chart's width in pixels (min and max per bucket) and sends full detail again
// when a chart is zoomed in; a running run's new points arrive as server-sent events.
"use strict";

const bt = (window.bt = { charts: {}, ready: false, updates: 0, lastUpdate: null, longTasks: [] });
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
const EVENT_STYLE = {
  anomaly: { marker: "x", color: "#d62728" },
  action: { marker: "inverted_triangle", color: "#9467bd" },
  skip: { marker: "diamond", color: "#ff7f0e" },
  warning: { marker: "square", color: "#8c564b" },
};

// ---- small helpers ---------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
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
  if (typeof x !== "number") return String(x);
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (a >= 1000 && a < 1e6) return x.toFixed(0);
  if (a >= 1e-3 && a < 1000) return String(Number(x.toPrecision(4)));
  return x.toExponential(2);
}

function fmtDuration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return `${s.toFixed(1)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleString() : "–");
const statusBadge = (status) => el("span", { class: `status status-${status}`, text: status });

function setMain(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
  return main;
}

function kvTable(obj) {
  const rows = Object.entries(obj || {}).map(([k, v]) =>
    el("tr", {}, el("td", { text: k }), el("td", { text: typeof v === "object" ? JSON.stringify(v) : String(v) })),
  );
  return rows.length ? el("table", { class: "kv" }, el("tbody", {}, ...rows)) : el("p", { class: "muted", text: "none" });
}

// A sortable table: columns [{key, label, num, render?}], rows of objects.
function sortableTable(columns, rows, { id } = {}) {
  let sortKey = null;
  let sortDir = 1;
  const tbody = el("tbody");
  const heads = columns.map((c) =>
    el("th", { text: c.label, title: c.title || c.label, onclick: () => sortBy(c.key) }),
  );
  function cell(c, row) {
    const td = el("td", { class: c.num ? "num" : "" });
    if (c.render) td.append(c.render(row));
    else td.textContent = c.num ? fmtValue(row[c.key]) : row[c.key] == null ? "–" : String(row[c.key]);
    return td;
  }
  function draw(list) {
    tbody.replaceChildren(...list.map((row) => el("tr", { "data-id": row.id || "" }, ...columns.map((c) => cell(c, row)))));
  }
  function sortBy(key) {
    sortDir = sortKey === key ? -sortDir : 1;
    sortKey = key;
    heads.forEach((h, i) => (h.className = columns[i].key === key ? (sortDir > 0 ? "sorted-asc" : "sorted-desc") : ""));
    rows.sort((a, b) => {
      const x = a[key], y = b[key];
      if (x == null) return 1;
      if (y == null) return -1;
      return (typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y))) * sortDir;
    });
    table.filter();
  }
  const table = el("table", id ? { id } : {}, el("thead", {}, el("tr", {}, ...heads)), tbody);
  table.filter = (text = table.lastFilter || "") => {
    table.lastFilter = text;
    const needle = text.toLowerCase();
    draw(needle ? rows.filter((r) => columns.some((c) => String(r[c.key] ?? "").toLowerCase().includes(needle))) : rows);
  };
  table.filter();
  return table;
}

// ---- runs table --------------------------------------------------------------------------------
async function runsView() {
  const data = await api("/api/runs");
  document.getElementById("store").textContent = data.store;
  document.title = "batchtap: runs";
  const selected = new Set();
  const configKeys = [...new Set(data.runs.flatMap((r) => Object.keys(r.config)))].sort();
  const rows = data.runs.map((r) => ({
    ...r,
    ...Object.fromEntries(configKeys.map((k) => [`config.${k}`, r.config[k]])),
  }));
  const columns = [
    {
      key: "select", label: "", render: (r) => el("input", {
        type: "checkbox", "aria-label": "select for comparison",
        onchange: (e) => (e.target.checked ? selected.add(r.id) : selected.delete(r.id)),
      }),
    },
    { key: "name", label: "name", render: (r) => el("a", { href: `/run/${encodeURIComponent(r.id)}`, text: r.name }) },
    { key: "status", label: "status", render: (r) => statusBadge(r.status) },
    { key: "started_at", label: "started", render: (r) => fmtTime(r.started_at) },
    { key: "duration", label: "duration", num: true, render: (r) => fmtDuration(r.duration) },
    { key: "steps", label: "steps", num: true },
    { key: "main", label: "metric" },
    { key: "last_value", label: "last", num: true },
    { key: "best_value", label: "best", num: true },
    { key: "anomalies", label: "anomalies", num: true },
    ...configKeys.map((k) => ({
      key: `config.${k}`, label: k, title: `config: ${k}`,
      num: rows.every((r) => r[`config.${k}`] == null || typeof r[`config.${k}`] === "number"),
    })),
  ];
  const table = sortableTable(columns, rows, { id: "runs" });
  const filter = el("input", { type: "search", placeholder: "filter runs (name, status, config…)", id: "filter" });
  filter.addEventListener("input", () => table.filter(filter.value));
  const compare = el("button", {
    text: "compare selected", id: "compare",
    onclick: () => {
      if (selected.size) location.href = `/compare?runs=${[...selected].map(encodeURIComponent).join(",")}`;
    },
  });
  setMain(
    el("h1", { text: `${data.runs.length} run${data.runs.length === 1 ? "" : "s"}` }),
    el("div", { class: "toolbar" }, filter, compare),
    el("div", { class: "tablewrap" }, table),
  );
  markReady();
  // Status, steps and values change in place while a run trains.
  if (data.runs.some((r) => r.status === "running")) setTimeout(() => refreshRuns(table, rows), 2000);
}

async function refreshRuns(table, rows) {
  const data = await api("/api/runs").catch(() => null);
  if (data) {
    const byId = Object.fromEntries(data.runs.map((r) => [r.id, r]));
    for (const row of rows) if (byId[row.id]) Object.assign(row, byId[row.id]);
    table.filter();
  }
  if (!data || data.runs.some((r) => r.status === "running")) setTimeout(() => refreshRuns(table, rows), 2000);
}

// ---- charts ------------------------------------------------------------------------------------
function ema(values, weight, prev = null) {
  // TensorBoard's smoothing: an exponential moving average that skips gaps (NaN, null).
  const out = new Array(values.length);
  let last = prev;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null || Number.isNaN(v)) { out[i] = NaN; continue; }
    last = last === null ? v : last * weight + (1 - weight) * v;
    out[i] = last;
  }
  return out;
}

function columnsOf(series, xKey = "step", x0 = 0) {
  // Bokeh columns from the server's; null values become NaN (a gap in the line).
  // Raw points come without lo, hi and mean: they are the step and the value.
  const nan = (a) => a.map((v) => (v === null ? NaN : v));
  const value = nan(series.value);
  return {
    x: xKey === "step" ? series.step.slice() : series.wall.map((w) => w - x0),
    step: series.step.slice(), lo: (series.lo || series.step).slice(), hi: (series.hi || series.step).slice(),
    value, mean: series.mean ? nan(series.mean) : value.slice(),
    wall_ms: series.wall.map((w) => w * 1000),
  };
}

function newFigure(title, xLabel, xRange) {
  const attrs = {
    height: 240, sizing_mode: "stretch_width", tools: "xpan,xwheel_zoom,box_zoom,reset,save", x_axis_label: xLabel, toolbar_location: "above", output_backend: "canvas",
  };
  if (xRange) attrs.x_range = xRange;
  const p = Bokeh.Plotting.figure(attrs);
  p.title.text = title; // drawn on the canvas as text
  return p;
}

function hover(renderers, tooltips, formatters) {
  return new Bokeh.HoverTool({ renderers, tooltips, formatters: formatters || {}, mode: "mouse" });
}

const LINE_TIPS = [["step", "@step (@lo – @hi)"], ["value", "@value{0.[0000]}"], ["wall time", "@wall_ms{%F %T}"]];

// One chart: a raw line, its smoothed line, event markers; more lines via `extra`.
class Chart {
  constructor({ runId, metric, title, xRange, sparse, extra = [], width = 800 }) {
    this.runId = runId; this.metric = metric; this.sparse = sparse; this.pixels = width;
    this.plot = newFigure(title, "step", xRange);
    this.lines = [];
    this.loaded = null; // [start, end] of a zoomed-in fetch, null for the whole run
    for (const [i, name] of [metric, ...extra].entries()) {
      const source = new Bokeh.ColumnDataSource({ data: { x: [], step: [], lo: [], hi: [], value: [], mean: [], wall_ms: [], smooth: [] } });
      const color = COLORS[i % COLORS.length];
      const label = extra.length ? (i === 0 ? `${name} (compute)` : `${name} (data wait)`) : name;
      const raw = this.plot.line({ field: "x" }, { field: "value" }, { source, line_color: color, line_alpha: 0.35, legend_label: extra.length ? label : undefined });
      const smooth = this.plot.line({ field: "x" }, { field: "smooth" }, { source, line_color: color, line_width: 2 });
      if (sparse) this.plot.scatter({ field: "x" }, { field: "value" }, { source, size: 6, fill_color: color, line_color: color });
      this.plot.add_tools(hover([raw], [["metric", label], ...LINE_TIPS], { "@wall_ms": "datetime" }));
      this.lines.push({ name, source, raw, smooth, mode: "raw", lastStep: -Infinity });
    }
    this.events = new Bokeh.ColumnDataSource({ data: { x: [], y: [], step: [], kind: [], message: [], marker: [], color: [] } });
    const marks = this.plot.scatter({ field: "x" }, { field: "y" }, {
      source: this.events, size: 12, marker: { field: "marker" }, line_color: { field: "color" },
      fill_color: { field: "color" }, line_width: 2,
    });
    this.plot.add_tools(hover([marks], [["event", "@kind at step @step"], ["message", "@message"]]));
    this.spans = [];
    if (extra.length) this.plot.legend.location = "top_left";
  }

  async load(start = null, end = null) {
    const q = (name) => {
      const params = new URLSearchParams({ metric: name, width: String(this.pixels) });
      if (start !== null) params.set("start", String(Math.floor(start)));
      if (end !== null) params.set("end", String(Math.ceil(end)));
      return api(`/api/runs/${encodeURIComponent(this.runId)}/series?${params}`);
    };
    const all = await Promise.all(this.lines.map((line) => q(line.name)));
    all.forEach((series, i) => this.replace(this.lines[i], series));
    this.loaded = start === null ? null : [start, end];
    this.placeEvents();
  }

  replace(line, series) {
    const data = columnsOf(series);
    data.smooth = ema(data.mean, this.sparse ? 0 : smoothing());
    line.mode = series.mode; line.rank = series.rank;
    line.lastStep = Math.max(line.lastStep, data.step.length ? data.step[data.step.length - 1] : -Infinity);
    line.source.data = data;
  }

  append(name, series) {
    const line = this.lines.find((l) => l.name === name);
    if (!line) return;
    const keep = series.step.map((s, i) => (s > line.lastStep ? i : -1)).filter((i) => i >= 0);
    if (!keep.length) return;
    const pick = (a) => keep.map((i) => a[i]);
    const data = columnsOf({ step: pick(series.step), value: pick(series.value), wall: pick(series.wall) });
    const prevSmooth = line.source.data.smooth;
    let prev = null;
    for (let i = prevSmooth.length - 1; i >= 0; i--) if (!Number.isNaN(prevSmooth[i])) { prev = prevSmooth[i]; break; }
    data.smooth = ema(data.mean, this.sparse ? 0 : smoothing(), prev);
    line.lastStep = data.step[data.step.length - 1];
    line.source.stream(data);
  }

  resmooth() {
    if (this.sparse) return;
    for (const line of this.lines) line.source.data = { ...line.source.data, smooth: ema(line.source.data.mean, smoothing()) };
  }

  // Markers for the events that concern this chart: anomalies of its metric; actions, skips and
  // warnings on every step chart (a rule's stop or rollback concerns the whole run).
  setEvents(events) {
    this.allEvents = events.filter((e) => (e.kind === "anomaly" ? this.lines.some((l) => l.name === e.metric) : !this.sparse));
    if (this.spans.length) this.plot.center = this.plot.center.filter((a) => !this.spans.includes(a));
    this.spans = [];
    for (const e of this.allEvents) {
      if (e.kind !== "action") continue;
      const span = new Bokeh.Span({ location: e.step, dimension: "height", line_color: EVENT_STYLE.action.color, line_dash: "dashed", line_width: 1 });
      this.plot.add_layout(span);
      this.spans.push(span);
    }
    this.placeEvents();
  }

  placeEvents() {
    const events = this.allEvents || [];
    const data = this.lines[0].source.data;
    const y = events.map((e) => nearestValue(data, e.step));
    this.events.data = {
      x: events.map((e) => e.step), y, step: events.map((e) => e.step), kind: events.map((e) => e.kind),
      message: events.map((e) => e.message), marker: events.map((e) => (EVENT_STYLE[e.kind] || EVENT_STYLE.warning).marker),
      color: events.map((e) => (EVENT_STYLE[e.kind] || EVENT_STYLE.warning).color),
    };
  }

  // After a zoom or pan: fetch detail when the view shows decimated points, or the whole run again
  // when it leaves the zoomed-in window that was fetched.
  onRange(x0, x1) {
    if (this.sparse) return;
    const decimated = this.lines.some((l) => l.mode === "minmax");
    const outside = this.loaded && (x0 < this.loaded[0] || x1 > this.loaded[1]);
    if (!decimated && !outside) return;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      const span = x1 - x0;
      this.load(outside && span > 0.5 * (this.fullSpan || span) ? null : x0 - span * 0.25, x1 + span * 0.25).catch(showError);
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

function smoothing() {
  const input = document.getElementById("smoothing");
  return input ? Number(input.value) : 0.6;
}

function smoothingControl(onChange) {
  const input = el("input", { type: "range", id: "smoothing", min: "0", max: "0.99", step: "0.01", value: "0.6" });
  const shown = el("span", { text: "0.60" });
  input.addEventListener("input", () => { shown.textContent = Number(input.value).toFixed(2); onChange(); });
  return el("label", {}, "smoothing ", input, " ", shown);
}

// ---- run page ----------------------------------------------------------------------------------
async function runView(runId) {
  const run = await api(`/api/runs/${encodeURIComponent(runId)}`);
  document.title = `batchtap: ${run.name}`;
  bt.run = run;
  const status = statusBadge(run.status);
  status.id = "status";
  const facts = el("div", { class: "facts" },
    el("span", {}, "id ", el("b", { text: run.id })),
    el("span", {}, "started ", el("b", { text: fmtTime(run.started_at) })),
    el("span", {}, "duration ", el("b", { id: "duration", text: fmtDuration(run.duration) })),
    el("span", {}, "last step ", el("b", { id: "steps", text: String(run.last_step ?? "–") })),
    el("span", {}, "world size ", el("b", { text: String(run.world_size) })),
    run.stop_reason ? el("span", { id: "stop-reason" }, "stop reason ", el("b", { text: run.stop_reason })) : null,
  );
  const chartsBox = el("div", { id: "charts" });
  const eventsBox = el("div", { id: "events" });
  const ranksBox = el("div", { id: "ranks" });
  setMain(
    el("h1", { id: "run-name", text: run.name }, " ", status),
    facts,
    el("div", { class: "toolbar" }, smoothingControl(() => Object.values(bt.charts).forEach((c) => c.resmooth()))),
    chartsBox,
    ranksBox,
    el("h2", { text: "events" }), eventsBox,
    el("h2", { text: "config" }), kvTable(run.config),
    el("h2", { text: "environment" }), kvTable(run.environment),
  );

  if (window.btEarly) await window.btEarly.ready; // early.js has asked for the lines by now
  const xRange = new Bokeh.DataRange1d();
  const stepMetrics = run.metrics.filter((m) => !run.sparse.includes(m));
  const columns = window.innerWidth >= 1100 ? 2 : 1;
  // The width early.js asked the lines for (its reads are then used), else the box's own.
  const width = (window.btEarly && window.btEarly.width) || Math.max(200, Math.floor(chartsBox.clientWidth / columns) - 40);
  for (const metric of stepMetrics) {
    if (metric === "data_time" && stepMetrics.includes("step_time")) continue; // drawn with step_time
    const extra = metric === "step_time" && stepMetrics.includes("data_time") ? ["data_time"] : [];
    const title = extra.length ? "time per step (s): compute = step_time, data wait = data_time" : metric;
    bt.charts[metric] = new Chart({ runId, metric, title, xRange, extra, width });
  }
  for (const metric of run.sparse) {
    bt.charts[metric] = new Chart({ runId, metric, title: `${metric} (tap.log)`, xRange, sparse: true, width });
  }
  const eventsPromise = api(`/api/runs/${encodeURIComponent(runId)}/events`);
  await Promise.all(Object.values(bt.charts).map((chart) => chart.load()));
  const { events } = await eventsPromise;
  showEvents(eventsBox, events);
  // One Bokeh document for every chart: they share the step axis (zoom one, all follow).
  const plots = Object.values(bt.charts).map((chart) => chart.plot);
  if (plots.length) {
    const grid = Bokeh.Plotting.gridplot(plots, { ncols: columns, sizing_mode: "stretch_width", toolbar_location: "right", merge_tools: true });
    await Bokeh.Plotting.show(grid, chartsBox);
  } else {
    chartsBox.append(el("p", { class: "muted", text: "no values stored yet" }));
  }
  for (const chart of Object.values(bt.charts)) chart.fullSpan = Math.max(1, run.last_step ?? 1);
  xRange.connect(xRange.change, () => {
    for (const chart of Object.values(bt.charts)) if (!chart.sparse) chart.onRange(xRange.start, xRange.end);
  });
  markReady();
  const perRank = Object.entries(run.ranks).filter(([, ranks]) => ranks.filter((r) => r >= 0).length > 1);
  if (perRank.length) showRanks(ranksBox, runId, perRank.map(([m]) => m)).catch(showError);
  if (run.status === "running") follow(run, events.length);
}

function showEvents(box, events) {
  bt.events = events;
  for (const chart of Object.values(bt.charts)) chart.setEvents(events);
  if (!events.length) { box.replaceChildren(el("p", { class: "muted", text: "no events" })); return; }
  const columns = [
    { key: "step", label: "step", num: true, render: (e) => String(e.step) },
    { key: "rank", label: "rank", num: true, render: (e) => (e.rank < 0 ? "all" : String(e.rank)) },
    { key: "kind", label: "kind" },
    { key: "metric", label: "metric" },
    { key: "raw", label: "raw value" },
    { key: "message", label: "message", render: (e) => el("span", { class: "message", text: e.message }) },
  ];
  box.replaceChildren(el("div", { class: "tablewrap" }, sortableTable(columns, events.slice(), { id: "events-table" })));
}

// The per-rank view (runs with per_rank_rows): per step the slowest rank, the largest and smallest value.
async function showRanks(box, runId, metrics) {
  const metric = metrics.includes("step_time") ? "step_time" : metrics[0];
  const data = await api(`/api/runs/${encodeURIComponent(runId)}/ranks?metric=${encodeURIComponent(metric)}&width=1000`);
  const nan = (a) => a.map((v) => (v === null ? NaN : v));
  const source = new Bokeh.ColumnDataSource({ data: { x: data.step, step: data.step, max: nan(data.max), min: nan(data.min), spread: nan(data.spread), slowest: data.slowest } });
  const p = newFigure(`${metric} across ranks ${data.ranks.join(", ")}: slowest rank, fastest, spread`, "step");
  const hi = p.line({ field: "x" }, { field: "max" }, { source, line_color: COLORS[3], legend_label: "slowest rank" });
  p.line({ field: "x" }, { field: "min" }, { source, line_color: COLORS[2], legend_label: "fastest rank" });
  p.line({ field: "x" }, { field: "spread" }, { source, line_color: COLORS[7], line_dash: "dashed", legend_label: "spread (max − min)" });
  p.add_tools(hover([hi], [["step", "@step"], ["slowest rank", "@slowest"], ["max", "@max"], ["min", "@min"], ["spread", "@spread"]]));
  p.legend.location = "top_left";
  const counts = {};
  for (const r of data.slowest) counts[r] = (counts[r] || 0) + 1;
  const summary = Object.entries(counts).sort((a, b) => b[1] - a[1]).map(([r, n]) => `rank ${r}: ${n}`).join(", ");
  const node = el("div", { class: "chart", id: "rank-chart" });
  box.replaceChildren(el("h2", { text: "ranks" }), el("p", { class: "muted", text: `slowest rank per step (count): ${summary}` }), node);
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
  source.addEventListener("update", (message) => {
    const update = JSON.parse(message.data);
    for (const [metric, series] of Object.entries(update.lines || {})) {
      const chart = bt.charts[metric] || Object.values(bt.charts).find((c) => c.lines.some((l) => l.name === metric));
      if (chart) chart.append(metric, series);
    }
    for (const chart of Object.values(bt.charts)) chart.placeEvents();
    if (update.events) showEvents(document.getElementById("events"), update.events);
    if (update.status) setStatus(update.status, update.stop_reason);
    const main = bt.charts[run.main];
    if (main) document.getElementById("steps").textContent = String(main.lines[0].lastStep);
    bt.updates += 1;
    bt.lastUpdate = { at: performance.timeOrigin + performance.now(), lastStep: main ? main.lines[0].lastStep : null };
  });
  source.addEventListener("end", (message) => {
    source.close();
    setStatus(JSON.parse(message.data).status);
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
  document.title = `batchtap: compare ${runs.length} runs`;
  const align = el("select", { id: "align" }, el("option", { value: "step", text: "align by step" }), el("option", { value: "wall", text: "align by wall time (s since start)" }));
  const box = el("div", { id: "charts" });
  const legend = el("ul", { id: "compare-runs" }, ...runs.map((r, i) => el("li", { style: `color:${COLORS[i % COLORS.length]}` }, el("a", { href: `/run/${encodeURIComponent(r.id)}`, text: r.name }), ` (${r.id.slice(0, 8)}, ${r.status})`)));
  setMain(el("h1", { text: "compare" }), legend, el("div", { class: "toolbar" }, align), box);
  const metrics = [...new Set(runs.flatMap((r) => r.metrics))];
  const draw = async () => {
    box.replaceChildren();
    bt.charts = {};
    const xKey = align.value;
    const xRange = new Bokeh.DataRange1d();
    const columns = window.innerWidth >= 1100 ? 2 : 1;
    const width = Math.max(200, Math.floor(box.clientWidth / columns) - 40);
    const plots = await Promise.all(metrics.map(async (metric) => {
      const p = newFigure(metric, xKey === "step" ? "step" : "seconds since the run started", xRange);
      const have = runs.filter((r) => r.metrics.includes(metric));
      const all = await Promise.all(have.map((r) => api(`/api/runs/${encodeURIComponent(r.id)}/series?metric=${encodeURIComponent(metric)}&width=${width}`)));
      const sources = all.map((series, i) => {
        const data = columnsOf(series, xKey, have[i].started_at);
        data.run = data.x.map(() => have[i].name);
        const source = new Bokeh.ColumnDataSource({ data });
        const color = COLORS[runs.indexOf(have[i]) % COLORS.length];
        const line = p.line({ field: "x" }, { field: "value" }, { source, line_color: color, line_alpha: 0.8, legend_label: `${have[i].name} (${have[i].id.slice(0, 8)})` });
        p.add_tools(hover([line], [["run", "@run"], ...LINE_TIPS], { "@wall_ms": "datetime" }));
        return source;
      });
      p.legend.location = "top_right";
      bt.charts[metric] = { sources, plot: p };
      return p;
    }));
    // One document for every chart: they share the x axis.
    await Bokeh.Plotting.show(Bokeh.Plotting.gridplot(plots, { ncols: columns, sizing_mode: "stretch_width", toolbar_location: "right", merge_tools: true }), box);
    markReady();
  };
  align.addEventListener("change", () => draw().catch(showError));
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
