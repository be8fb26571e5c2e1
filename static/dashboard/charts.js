// The pipeline page's load charts (uPlot). Every swap of a load element (#load-<instance>, rendered by
// controlplane/dashboard/partials.py) adds a point from its data-* attributes to that instance's
// history; the last KEEP points are kept. Histories live here rather than in the charts, so a
// re-rendered panel picks its instance's series up again. No polling: points come only from pushes.
// A chart none of whose figures the engine reports (llama.cpp reports no KV cache use) says so instead
// of drawing empty axes, and a chart is drawn from its second point, over at least a minute.
"use strict";

(() => {
  const KEEP = 120;
  const MIN_SPAN_S = 60;
  // chart name -> its series: [label, data-* field (camelCase), scale, colour]
  const CHARTS = {
    cache: {
      none: "The engine reports no KV cache figures.",
      range: [0, 100],
      series: [
        ["KV cache %", "kvUsage", 100, "#3366cc"],
        ["prefix hits %", "prefixHitRate", 100, "#2e9e5b"],
      ],
    },
    requests: {
      none: "The engine reports no request counts.",
      series: [
        ["running", "running", 1, "#3366cc"],
        ["waiting", "waiting", 1, "#d9822b"],
        ["active", "activeRequests", 1, "#888888"],
      ],
    },
    tokens: { none: "The engine reports no token counts.", series: [["tokens/s", "tokensPerS", 1, "#7a4bc2"]] },
  };
  const FIELDS = Object.values(CHARTS).flatMap((chart) => chart.series.map(([, field, scale]) => [field, scale]));
  const histories = new Map(); // instance id -> {last, times: [], values: {field: []}}
  const plots = new WeakMap(); // chart element -> uPlot

  function record(element) {
    const data = element.dataset;
    if (!data.at) return;
    const at = Number(data.at);
    let history = histories.get(data.instance);
    if (!history) {
      history = { last: null, times: [], values: {} };
      for (const [field] of FIELDS) history.values[field] = [];
      histories.set(data.instance, history);
    }
    if (history.last === at) return; // the same push, seen again by another swap event
    history.last = at;
    history.times.push(at);
    for (const [field, scale] of FIELDS) {
      history.values[field].push(data[field] === undefined ? null : Number(data[field]) * scale);
    }
    if (history.times.length > KEEP) {
      history.times.shift();
      for (const column of Object.values(history.values)) column.shift();
    }
  }

  function options(chart, element) {
    return {
      width: Math.max(element.clientWidth, 200),
      height: 130,
      cursor: { drag: { x: false, y: false } },
      // The legend names the series; values appear under the cursor only (not "--" at rest).
      legend: { live: false },
      // At least the last minute: one point alone would otherwise span years ("May Nov May Nov").
      scales: { x: { time: true, range: (u, min, max) => [Math.min(min, max - MIN_SPAN_S), max] }, y: chart.range ? { range: chart.range } : { range: (u, min, max) => [0, Math.max(1, max)] } },
      axes: [{ size: 30 }, { size: 40 }],
      series: [{}, ...chart.series.map(([label, , , stroke]) => ({ label, stroke, width: 1.5 }))],
    };
  }

  function draw() {
    for (const element of document.querySelectorAll(".chart[data-instance][data-chart]")) {
      const chart = CHARTS[element.dataset.chart];
      const history = histories.get(element.dataset.instance);
      if (!chart || !history) continue;
      const columns = chart.series.map(([, field]) => history.values[field]);
      const plot = plots.get(element);
      if (!plot && !columns.some((column) => column.some((value) => value !== null))) {
        // Nothing to draw: say why, once the engine has reported (and until it reports a figure).
        if (element.textContent !== chart.none) {
          element.textContent = chart.none;
          element.classList.add("no-figures");
        }
        continue;
      }
      const data = [history.times, ...columns];
      if (plot) {
        plot.setData(data);
      } else if (history.times.length >= 2) {
        element.replaceChildren();
        element.classList.remove("no-figures");
        plots.set(element, new uPlot(options(chart, element), data, element));
      }
    }
  }

  let drawing = false;
  function refresh() {
    // Record at once (a later push may replace the element), draw once per frame.
    for (const element of document.querySelectorAll(".load[data-instance]")) record(element);
    if (drawing) return;
    drawing = true;
    requestAnimationFrame(() => {
      drawing = false;
      draw();
    });
  }

  for (const name of ["htmx:oobAfterSwap", "htmx:afterSwap", "htmx:wsAfterMessage"]) {
    document.addEventListener(name, refresh);
  }
  refresh();
})();
