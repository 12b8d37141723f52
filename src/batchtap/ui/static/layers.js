// batchtap ui: a run page's per-layer section (bt.metrics.Layers and bt.metrics.Histograms).
//
// The per-layer curves are charts of app.js (one per kind, a line per layer). This script runs
// after app.js has drawn the run page (window.bt.ready), reads /api/runs/{id}/layers and
// /api/runs/{id}/histograms, and adds below the charts: a table of each layer's latest gradient
// norm, weight norm and update ratio (the top layers by gradient norm; "all" shows every one), and
// small multiples of one heatmap per layer and kind: a column per captured step, a row per bin (the bins span that
// step's own [min, max], shown in the column's tooltip), darker = more values (log scale).
// Every name from the store goes into the page as text (textContent), as in app.js.
"use strict";

(function () {
  const match = window.location.pathname.match(/^\/run\/([^/]+)$/);
  if (!match) return;
  const runRef = decodeURIComponent(match[1]);

  function node(tag, text, cls) {
    const n = document.createElement(tag);
    if (text != null) n.textContent = text;
    if (cls) n.className = cls;
    return n;
  }

  function fmt(v) {
    return v == null ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : v.toPrecision(4);
  }

  async function get(path) {
    const response = await fetch(path, { credentials: "same-origin" });
    if (!response.ok) throw new Error(`${response.status} ${path}`);
    return response.json();
  }

  function table(data, showAll) {
    const shown = showAll ? data.layers : data.layers.filter((l) => data.top.includes(l.layer));
    const t = node("table", null, "bt-layers-table");
    const head = node("tr");
    for (const h of ["layer", ...data.kinds, "step"]) head.append(node("th", h));
    t.append(head);
    for (const l of shown) {
      const row = node("tr");
      row.append(node("td", l.layer));
      for (const k of data.kinds) row.append(node("td", fmt(l[k])));
      row.append(node("td", l.step == null ? "" : String(l.step)));
      t.append(row);
    }
    return t;
  }

  function heatmap(h) {
    const steps = h.steps.length;
    const bins = steps ? h.counts[0].length : 0;
    const canvas = document.createElement("canvas");
    canvas.width = Math.max(1, steps);
    canvas.height = Math.max(1, bins);
    canvas.className = "bt-heatmap";
    canvas.style.width = "100%";
    canvas.style.height = "90px";
    canvas.style.imageRendering = "pixelated";
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(canvas.width, canvas.height);
    let most = 1;
    for (const column of h.counts) for (const c of column) most = Math.max(most, c);
    const scale = Math.log1p(most);
    for (let x = 0; x < steps; x++) {
      for (let b = 0; b < bins; b++) {
        const y = bins - 1 - b; // low values at the bottom
        const v = Math.log1p(h.counts[x][b]) / scale;
        const i = 4 * (y * canvas.width + x);
        image.data[i] = Math.round(255 * (1 - v));
        image.data[i + 1] = Math.round(255 * (1 - 0.7 * v));
        image.data[i + 2] = 255;
        image.data[i + 3] = 255;
      }
    }
    ctx.putImageData(image, 0, 0);
    canvas.addEventListener("mousemove", (event) => {
      const x = Math.min(steps - 1, Math.floor((event.offsetX / canvas.clientWidth) * steps));
      canvas.title = `step ${h.steps[x]}: [${fmt(h.low[x])}, ${fmt(h.high[x])}]`;
    });
    const figure = node("figure", null, "bt-heatmap-figure");
    figure.append(node("figcaption", `${h.kind} histogram: ${h.layer}`), canvas);
    return figure;
  }

  async function draw() {
    const base = `/api/runs/${encodeURIComponent(runRef)}`;
    const [layers, histograms] = await Promise.all([get(`${base}/layers`), get(`${base}/histograms`)]);
    if (!layers.layers.length && !histograms.histograms.length) return;
    const section = node("section", null, "bt-layers");
    section.id = "bt-layers";
    section.append(node("h2", "layers"));
    if (layers.layers.length) {
      let all = false;
      const holder = node("div");
      holder.append(table(layers, all));
      if (layers.layers.length > layers.top.length) {
        const toggle = node("button", "all layers");
        toggle.addEventListener("click", () => {
          all = !all;
          toggle.textContent = all ? `top ${layers.top.length}` : "all layers";
          holder.replaceChildren(table(layers, all));
        });
        section.append(toggle);
      }
      section.append(holder);
    }
    if (histograms.histograms.length) {
      // small multiples: one heatmap per kind and layer, layers in their model order (0, 2, 10)
      const natural = (a, b) => a.kind.localeCompare(b.kind) || a.layer.localeCompare(b.layer, undefined, { numeric: true });
      const grid = node("div", null, "bt-heatmaps");
      for (const h of histograms.histograms.slice().sort(natural)) grid.append(heatmap(h));
      section.append(node("h3", "histograms (a column per captured step, a row per bin of that step's [min, max])"), grid);
    }
    const ranks = document.getElementById("ranks"); // right below the charts, above the events
    if (ranks) ranks.after(section);
    else document.getElementById("main").append(section);
    window.bt.layersDrawn = true;
  }

  function whenReady(tries) {
    if (window.bt && window.bt.ready) draw().catch((e) => console.warn("batchtap layers:", e));
    else if (tries > 0) setTimeout(() => whenReady(tries - 1), 100);
  }
  document.addEventListener("DOMContentLoaded", () => whenReady(600));
})();
