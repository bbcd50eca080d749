"use strict";
// The prompt lens: draw the server's figures (the prompts × steps heatmap, a prompt's history),
// and open a heatmap cell's group in the step viewer on click.
(() => {
  const page = RL.pageData();
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false, doubleClick: "reset" };

  /** A group's page in the step viewer: /runs/{id}/steps/{step}/groups/{group}. */
  const groupUrl = (steps, step, group) => `${steps}/${step}/groups/${group}`;

  for (const fig of page.figures || []) {
    const el = document.getElementById(`fig-${fig.id}`);
    if (!el) continue;
    Plotly.newPlot(el, fig.data, fig.layout, CONFIG);
    el.figure = fig;
    const steps = el.dataset.steps || page.steps;
    if (!steps) continue;
    el.on("plotly_click", (event) => {
      const point = event.points && event.points[0];
      if (!point) return;
      const cell = point.customdata;
      // a heatmap cell carries [step, group, …]; a history point its group (its x is the step)
      if (Array.isArray(cell)) window.location.assign(groupUrl(steps, cell[0], cell[1]));
      else if (Number.isInteger(cell) && Number.isFinite(point.x)) window.location.assign(groupUrl(steps, point.x, cell));
    });
  }
  // a group's completions: the row under it, opened and closed in place (a plain link to the row
  // opens one at a time without script, by :target)
  for (const toggle of document.querySelectorAll("a.completions-toggle")) {
    toggle.addEventListener("click", (event) => {
      event.preventDefault();
      const row = document.getElementById(toggle.getAttribute("aria-controls"));
      if (!row) return;
      const open = !row.classList.contains("open");
      row.classList.toggle("open", open);
      toggle.setAttribute("aria-expanded", String(open));
    });
  }
  document.body.dataset.chartsReady = "true";
})();
