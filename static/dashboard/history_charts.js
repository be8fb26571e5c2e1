// Charts with history (uPlot): each .history[data-scope] element draws the metric samples of its scope (the fleet,
// a pipeline, a node) from /metrics/history/ (controlplane/dashboard/metrics_history.py), over the range its
// select chooses (1 h by default, 6 h, 24 h), and fetches them again every REFRESH_S: the charts follow live.
// A figure with no point in the range says so instead of drawing empty axes.
"use strict";

(() => {
  const REFRESH_S = 10;
  const GIB = 1024 ** 3;
  // scope -> its charts: [title, [[label, field, scale, colour]...], the least top of its y axis (so that a chart
  // of zeros reads 0..1 or 0..100, not 0..0.001)]
  const CHARTS = {
    requests: [
      ["Requests/s and error %", [["requests/s", "requests_per_s", 1, "#3366cc"], ["errors %", "error_rate", 100, "#b3261e"]], 1],
      ["TTFT (s)", [["p50", "ttft_p50_s", 1, "#2e9e5b"], ["p95", "ttft_p95_s", 1, "#d9822b"], ["p99", "ttft_p99_s", 1, "#b3261e"]], 0.1],
      ["ITL (s)", [["p50", "itl_p50_s", 1, "#2e9e5b"], ["p95", "itl_p95_s", 1, "#d9822b"]], 0.1],
      ["Queue depth", [["waiting", "queue_depth", 1, "#d9822b"]], 1],
      ["KV use and prefix hits %", [["KV use %", "kv_usage", 100, "#3366cc"], ["prefix hits %", "prefix_hit_rate", 100, "#2e9e5b"]], 100],
    ],
    node: [
      ["Memory (GiB)", [["used", "memory_used_bytes", 1 / GIB, "#3366cc"], ["total", "memory_total_bytes", 1 / GIB, "#888888"]], 1],
      ["GPU memory (GiB)", [["used", "gpu_memory_used_bytes", 1 / GIB, "#7a4bc2"], ["total", "gpu_memory_total_bytes", 1 / GIB, "#888888"]], 1],
      ["Utilisation %", [["CPU", "cpu_utilization_percent", 1, "#d9822b"], ["GPU mean", "gpu_utilization_percent", 1, "#2e9e5b"]], 100],
    ],
  };

  function url(element) {
    const range = element.querySelector("select[name='range']");
    const query = new URLSearchParams({ scope: element.dataset.scope, range: range ? range.value : "1h" });
    if (element.dataset.id) query.set("id", element.dataset.id);
    return element.dataset.url + "?" + query;
  }

  function say(box, text) {
    box.replaceChildren();
    const note = document.createElement("p");
    note.className = "empty";
    note.textContent = text;
    box.append(note);
  }

  function draw(element, data) {
    const charts = CHARTS[element.dataset.scope === "node" ? "node" : "requests"];
    const boxes = element.querySelector(".history-charts");
    // Every box goes in before any chart is drawn: a chart takes the width of its box when drawn, and a box
    // alone in the row would be the row's whole width, then overlap the boxes that join it.
    const plots = charts.map(([title]) => {
      const box = document.createElement("figure");
      box.className = "history-chart";
      const caption = document.createElement("figcaption");
      caption.textContent = title;
      const plot = document.createElement("div");
      box.append(caption, plot);
      return [box, plot];
    });
    boxes.replaceChildren(...plots.map(([box]) => box));
    for (const [index, [, series, floor]] of charts.entries()) {
      const plot = plots[index][1];
      const columns = series.map(([, field, scale]) =>
        (data.series[field] || []).map((value) => (value === null || value === undefined ? null : value * scale)),
      );
      if (!columns.some((column) => column.some((value) => value !== null))) {
        say(plot, "No figure in this range.");
        continue;
      }
      const options = {
        width: Math.max(plot.clientWidth || 260, 260),
        height: 140,
        cursor: { drag: { x: false, y: false } },
        legend: { live: false },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max, floor)] } },
        axes: [{ size: 30 }, { size: 50 }],
        series: [{}, ...series.map(([label, , , stroke]) => ({ label, stroke, width: 1.5, spanGaps: false }))],
      };
      new uPlot(options, [data.times, ...columns], plot);
    }
    const source = element.querySelector(".history-source");
    if (source) source.textContent = data.source === "prometheus" ? "from Prometheus" : "from the control plane's samples";
  }

  async function load(element) {
    try {
      const response = await fetch(url(element), { headers: { Accept: "application/json" } });
      const data = await response.json();
      if (!response.ok) {
        say(element.querySelector(".history-charts"), data.error || `HTTP ${response.status}`);
        return;
      }
      draw(element, data);
    } catch (error) {
      say(element.querySelector(".history-charts"), "The history could not be read: " + error);
    }
  }

  for (const element of document.querySelectorAll(".history[data-scope]")) {
    const range = element.querySelector("select[name='range']");
    if (range) range.addEventListener("change", () => load(element));
    load(element);
    setInterval(() => load(element), REFRESH_S * 1000);
  }
})();
