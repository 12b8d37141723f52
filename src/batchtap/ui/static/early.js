// batchtap ui: a run page's reads, started before BokehJS has loaded.
//
// Loaded before the chart library (a plain script in <head>, a few hundred bytes), so the run's
// record, its events and every line at the chart width are asked for while the browser still
// downloads and compiles BokehJS (~0.6-0.9 s on a loaded 2-core machine): the server reads the
// store meanwhile. app.js takes these responses through api() when it asks for the same URL; a
// response nobody takes is simply dropped.
"use strict";
(function () {
  // ready: settled once the lines' requests are made (app.js waits for it, so that it never asks
  // for a line that early.js is about to ask for).
  const early = (window.btEarly = { width: null, responses: new Map(), ready: Promise.resolve() });
  early.take = (path) => {
    const response = early.responses.get(path);
    early.responses.delete(path); // a body is read once
    return response;
  };
  const match = location.pathname.match(/^\/run\/([^/]+)$/);
  if (!match || !window.fetch) return;
  // The width in pixels each chart's line is decimated to (app.js uses the same number): two
  // columns of charts on a wide window, the page's side padding (2 x 1.2em) and the axis taken off.
  const columns = window.innerWidth >= 1100 ? 2 : 1;
  early.width = Math.max(200, Math.floor((document.documentElement.clientWidth - 34) / columns) - 40);
  const id = encodeURIComponent(decodeURIComponent(match[1]));
  const get = (path) => {
    const response = fetch(path, { credentials: "same-origin" });
    response.catch(() => {}); // app.js reports errors when it takes the response
    early.responses.set(path, response);
    return response;
  };
  get(`/api/runs/${id}/events`);
  get(`/api/runs/${id}/epochs`);
  early.ready = get(`/api/runs/${id}`)
    .then((response) => (response.ok ? response.clone().json() : null))
    .then((run) => {
      if (!run) return;
      for (const metric of run.metrics || []) {
        // per-layer values: app.js reads the few lines each family shows by default, not all
        if (/^(grad_norm|weight_norm|update_ratio)\//.test(metric)) continue;
        get(`/api/runs/${id}/series?${new URLSearchParams({ metric, width: String(early.width) })}`);
      }
    })
    .catch(() => {});
})();
