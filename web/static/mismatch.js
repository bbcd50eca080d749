"use strict";
// The mismatch drill-down: draw the server's figures (the log-ratio histogram, generator vs
// trainer probability) and open a scatter point's rollout in the step viewer on click.
(() => {
  const page = RL.pageData();
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false, doubleClick: "reset" };

  /** A rollout in the step viewer: /runs/{id}/steps/{step}/groups/{group}#r{index}. */
  const rolloutUrl = (steps, [step, group, index]) => `${steps}/${step}/groups/${group}#r${index}`;

  for (const fig of page.figures || []) {
    const el = document.getElementById(`fig-${fig.id}`);
    if (!el) continue;
    Plotly.newPlot(el, fig.data, fig.layout, CONFIG);
    el.figure = fig;
    el.on("plotly_click", (event) => {
      const point = event.points && event.points[0];
      const owner = point && point.customdata;
      // a scatter point carries its rollout's [step, group, index]; a histogram bar its range
      if (Array.isArray(owner) && owner.length === 3 && owner.every(Number.isInteger)) {
        window.location.assign(rolloutUrl(page.steps, owner));
      }
    });
  }
  document.body.dataset.chartsReady = "true";
})();
