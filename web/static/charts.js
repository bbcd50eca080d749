"use strict";
// Plotly glue: draw the server's figures, fill them from the series API, keep x axes in step.
window.RL.charts = (() => {
  const CONFIG = {
    displaylogo: false,
    responsive: true,
    modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d", "toggleSpikelines"],
    toImageButtonOptions: { format: "png", scale: 2 },
  };
  const ALERT_COLORS = {
    reward_hacking: "#dc2626",
    collapse: "#d97706",
    control_token_spike: "#9333ea",
    signal_loss: "#64748b",
  };

  function draw(fig) {
    const el = document.getElementById(`fig-${fig.id}`);
    Plotly.newPlot(el, fig.data, fig.layout, CONFIG);
    el.figure = fig;
    return el;
  }

  /** Series names the figure's traces read (meta.series). */
  function seriesNames(figs) {
    const names = new Set();
    for (const fig of figs) for (const t of fig.data) if (t.meta && t.meta.series) names.add(t.meta.series);
    return [...names];
  }

  /** Append a series payload to every trace that reads one of its series; true if anything changed. */
  function appendSeries(el, payload) {
    let changed = false;
    for (const trace of el.data) {
      const meta = trace.meta || {};
      const data = meta.series && payload.series[meta.series];
      if (!data || !data.x.length) continue;
      trace.x = trace.x.concat(data.x);
      trace.y = trace.y.concat(data[meta.part] || data.y); // raw points: lo = hi = y
      changed = true;
    }
    return changed;
  }

  /** Fill a figure's per-run traces (meta.run) from each run's series before it is drawn:
   *  the page sends a series' steps once, not once per trace. */
  function fillRuns(fig, byRun) {
    for (const trace of fig.data) {
      const meta = trace.meta || {};
      const run = byRun[meta.run];
      const data = run && run.series[meta.series];
      if (!data) continue;
      trace.x = data.x;
      trace.y = data[meta.part] || data.y; // no band sent: lo = hi = y
    }
    return fig;
  }

  /** Replace the 25-step buckets a payload brings (the last one may still be filling). */
  function applyBuckets(el, buckets) {
    if (!buckets || !buckets.start.length) return false;
    const first = buckets.start[0];
    let changed = false;
    for (const trace of el.data) {
      const key = trace.meta && trace.meta.bucket;
      if (!key) continue;
      let keep = trace.x.length;
      while (keep > 0 && trace.x[keep - 1] >= first) keep -= 1;
      trace.x = trace.x.slice(0, keep).concat(buckets.start);
      trace.y = trace.y.slice(0, keep).concat(buckets[key]);
      trace.mode = trace.x.length > 80 ? "lines" : "lines+markers"; // markers only while readable
      changed = true;
    }
    return changed;
  }

  function hasData(el) {
    return el.data.some((t) => t.meta && (t.meta.part === "y" || t.meta.bucket) && t.y.some((v) => v !== null));
  }

  /** A dotted vertical line at each alert this chart shows. */
  function alertShapes(alerts, kinds) {
    return alerts
      .filter((a) => kinds.includes(a.kind))
      .map((a) => ({
        type: "line", xref: "x", yref: "paper", x0: a.step, x1: a.step, y0: 0, y1: 1,
        line: { color: ALERT_COLORS[a.kind] || "#334155", width: 1.5, dash: "dot" }, layer: "above",
      }));
  }

  /** A ⚠ marker at the top of each alert's line: hover says what fired, a click opens the step. */
  function alertMarkers(alerts, kinds) {
    return alerts
      .filter((a) => kinds.includes(a.kind))
      .map((a) => ({
        x: a.step, xref: "x", y: 1, yref: "paper", yanchor: "top", showarrow: false,
        text: "⚠", font: { size: 11, color: ALERT_COLORS[a.kind] || "#334155" },
        bgcolor: "#ffffff", bordercolor: ALERT_COLORS[a.kind] || "#334155", borderwidth: 1, borderpad: 1,
        hovertext: `${a.label}: ${a.message}`, captureevents: true,
        name: `alert-${a.kind}-${a.step}`,
      }));
  }

  /** A shaded band over each SFT phase ([x0, x1] in steps), under the data. */
  function bandShapes(bands) {
    return bands.map(([x0, x1]) => ({
      type: "rect", xref: "x", yref: "paper", x0, x1, y0: 0, y1: 1, layer: "below",
      fillcolor: "rgba(13, 148, 136, 0.16)", line: { width: 1, color: "rgba(13, 148, 136, 0.45)" },
    }));
  }

  /** Redraw after in-place changes (datarevision tells Plotly.react that data changed).
   *  marks: {alerts, bands} drawn on every chart that shows that kind of alert / on every chart. */
  function redraw(el, marks) {
    const layout = el.layout;
    layout.datarevision = (layout.datarevision || 0) + 1;
    if (marks) {
      const kinds = (el.figure && el.figure.alerts) || [];
      layout.shapes = bandShapes(marks.bands || []).concat(alertShapes(marks.alerts || [], kinds));
      layout.annotations = alertMarkers(marks.alerts || [], kinds);
    }
    Plotly.react(el, el.data, layout, CONFIG);
    el.closest("figure").classList.toggle("no-data", !hasData(el));
    const last = el.figure && document.querySelector(`[data-last-of="${el.figure.id}"]`);
    if (last) last.textContent = lastValue(el);
  }

  /** "· last 0.0123" for a small chart's caption: its main trace's latest value. */
  function lastValue(el) {
    const trace = el.data.find((t) => t.meta && t.meta.part === "y");
    const ys = trace ? trace.y.filter((v) => v !== null) : [];
    return ys.length ? `· last ${Number(ys[ys.length - 1]).toPrecision(3)}` : "";
  }

  /** Zooming one chart's step axis zooms the rest of `group` (a shared axis across plots).
   *  `group` is an array the caller keeps; charts added later join it. */
  function syncX(group, els) {
    for (const el of els) {
      group.push(el);
      el.on("plotly_relayout", (event) => {
        if (group.syncing) return;
        let update = null;
        if (event["xaxis.range[0]"] !== undefined) update = { "xaxis.range": [event["xaxis.range[0]"], event["xaxis.range[1]"]] };
        else if (event["xaxis.range"]) update = { "xaxis.range": event["xaxis.range"] };
        else if (event["xaxis.autorange"]) update = { "xaxis.autorange": true };
        if (!update) return;
        group.syncing = true;
        Promise.all(group.filter((o) => o !== el).map((o) => Plotly.relayout(o, update))).finally(() => {
          group.syncing = false;
        });
      });
    }
  }

  /** Call fn(step) when a point or an alert marker is clicked. */
  function onStepClick(el, fn) {
    el.on("plotly_click", (event) => {
      const point = event.points && event.points[0];
      if (point && Number.isFinite(point.x)) fn(Math.round(point.x));
    });
    el.on("plotly_clickannotation", (event) => {
      const x = event.annotation && Number(event.annotation.x);
      if (Number.isFinite(x)) fn(Math.round(x));
    });
  }

  return { draw, fillRuns, seriesNames, appendSeries, applyBuckets, hasData, redraw, syncX, onStepClick, ALERT_COLORS };
})();
