// The Usage page's two charts (uPlot): per key and per model, one point a UTC day, from the data the
// server rendered into #usage-data (controlplane/dashboard/usage.py's charts()). The radio buttons switch
// both between tokens and requests.
"use strict";

(() => {
  const COLOURS = ["#3366cc", "#d9822b", "#2e9e5b", "#7a4bc2", "#b3261e", "#1b9aaa", "#8c6d1f", "#c2185b", "#667"];
  const source = document.getElementById("usage-data");
  if (!source) return;
  const data = JSON.parse(source.textContent);
  const plots = [];

  function measure() {
    const checked = document.querySelector("input[name='measure']:checked");
    return checked ? checked.value : "tokens";
  }

  function draw() {
    for (const plot of plots.splice(0)) plot.destroy();
    const what = measure();
    for (const element of document.querySelectorAll(".usage-chart[data-chart]")) {
      const lines = data[element.dataset.chart] || [];
      element.replaceChildren();
      if (!lines.length || !data.days.length) {
        const empty = document.createElement("p");
        empty.className = "empty";
        empty.textContent = "Nothing used on these days.";
        element.append(empty);
        continue;
      }
      const options = {
        width: Math.max(element.clientWidth, 240),
        height: 220,
        cursor: { drag: { x: false, y: false } },
        // The legend names the lines; values appear under the cursor only (not "--" at rest).
        legend: { live: false },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max)] } },
        axes: [{ size: 30 }, { size: 60 }],
        series: [
          { value: (u, v) => (v == null ? "" : new Date(v * 1000).toISOString().slice(0, 10)) },
          ...lines.map((line, i) => ({
            label: line.label,
            stroke: COLOURS[i % COLOURS.length],
            width: 1.5,
            points: { show: data.days.length <= 62 },
          })),
        ],
      };
      plots.push(new uPlot(options, [data.days, ...lines.map((line) => line[what])], element));
    }
  }

  for (const radio of document.querySelectorAll("input[name='measure']")) radio.addEventListener("change", draw);
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(draw, 200);
  });
  draw();
})();
