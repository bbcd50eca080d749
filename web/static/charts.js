"use strict";
// Plotly glue: draw the server's figures, fill them from the series API, keep x axes in step,
// and apply the page's one smoothing and log-scale setting (kept in the URL) to every chart.
window.RL.charts = (() => {
  // No mode bar: it sat on legends and data wherever hover is missing (touch, headless).
  // Drag zooms, double-click resets; the chart note says so.
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false, doubleClick: "reset" };
  const ALERT_COLORS = {
    reward_hacking: "#dc2626",
    collapse: "#d97706",
    control_token_spike: "#9333ea",
    signal_loss: "#64748b",
    mismatch: "#be123c",
  };

  // --- the page's view: smoothing and log scale, read from and written to the URL ---------------

  const view = readView();
  const drawnEls = []; // every chart drawn on the page: a view change reshapes them all
  const raw = new WeakMap(); // trace → the values as received ({y}), before smoothing
  const baseAxes = new WeakMap(); // chart → its y axes as the server laid them out
  const baseWidth = new WeakMap(); // trace → its line width as the server set it
  const baseMode = new WeakMap(); // trace → its mode as the server set it
  const baseName = new WeakMap(); // trace → its legend name as the server set it
  let stepRange = null; // [first, last] step the page's charts share on their x axis

  /** The view the URL asks for; without `smooth` the page's default applies (auto). */
  function readView() {
    const params = new URLSearchParams(window.location.search);
    const smooth = Number(params.get("smooth"));
    const asked = params.has("smooth") && Number.isFinite(smooth);
    return { smooth: asked && smooth > 0 && smooth < 1 ? Math.round(smooth * 100) / 100 : 0, auto: !asked, log: params.get("log") === "1" };
  }

  function writeView() {
    const url = new URL(window.location.href);
    if (!view.auto) url.searchParams.set("smooth", String(view.smooth)); // 0 too: raw, asked for
    else url.searchParams.delete("smooth");
    if (view.log) url.searchParams.set("log", "1");
    else url.searchParams.delete("log");
    history.replaceState(null, "", url);
  }

  /** W&B's exponential moving average, debiased (the first points are not pulled to 0);
   *  nulls stay gaps and do not count. weight 0 returns the values unchanged. */
  function ema(values, weight) {
    if (!weight) return values;
    let last = 0;
    let n = 0;
    return values.map((v) => {
      if (v === null || v === undefined || !Number.isFinite(v)) return null;
      last = last * weight + (1 - weight) * v;
      n += 1;
      return last / (1 - weight ** n);
    });
  }

  function rawOf(trace) {
    if (!raw.has(trace)) raw.set(trace, { y: trace.y.slice() });
    return raw.get(trace);
  }

  /** Set every series trace's shown values from its raw ones and the view: the mean line
   *  smoothed; its band spans the raw values (min–max) and the smoothed line. */
  function shape(el) {
    const byKey = new Map();
    for (const trace of el.data) {
      const meta = trace.meta || {};
      if (!meta.series) continue;
      const key = `${meta.run}:${meta.series}`;
      if (!byKey.has(key)) byKey.set(key, {});
      byKey.get(key)[meta.part] = trace;
    }
    for (const parts of byKey.values()) {
      if (!parts.y) continue;
      const smooth = parts.y.stackgroup ? 0 : view.smooth; // stacked shares stay shares
      const mean = ema(rawOf(parts.y).y, smooth);
      parts.y.y = mean;
      if (parts.lo) parts.lo.y = rawOf(parts.lo).y.map((v, i) => (smooth && mean[i] !== null && v !== null ? Math.min(v, mean[i]) : v));
      if (parts.hi) parts.hi.y = rawOf(parts.hi).y.map((v, i) => (smooth && mean[i] !== null && v !== null ? Math.max(v, mean[i]) : v));
    }
    markLonePoints(el);
    legendValues(el);
    nestOverlaps(el);
    applyAxes(el);
  }

  function nameOf(trace) {
    return baseName.has(trace) ? baseName.get(trace) : trace.name;
  }

  /** A figure with `legend_last` names each line's last raw value in its key ("open tag first
   *  · 1"): lines that lie on one another at 0 or 1 are told apart there. */
  function legendValues(el) {
    if (!(el.figure && el.figure.legend_last)) return;
    for (const trace of el.data) {
      if (!(trace.meta && trace.meta.part === "y")) continue;
      if (!baseName.has(trace)) baseName.set(trace, trace.name);
      const ys = rawOf(trace).y.filter((v) => v !== null && v !== undefined);
      const last = ys[ys.length - 1];
      const shown = Math.abs(last) < 0.001 && last !== 0 ? "< 0.001" : short(last);
      trace.name = ys.length ? `${baseName.get(trace)} · ${shown}` : baseName.get(trace);
    }
  }

  /** A line through one point draws nothing: a series with a single point shows it as a dot. */
  function markLonePoints(el) {
    for (const trace of el.data) {
      if (!(trace.meta && trace.meta.part === "y" && trace.line)) continue;
      if (!baseMode.has(trace)) baseMode.set(trace, trace.mode || "lines");
      const points = trace.y.filter((v) => v !== null && v !== undefined).length;
      const lone = points === 1 && !baseMode.get(trace).includes("markers");
      trace.mode = lone ? "lines+markers" : baseMode.get(trace);
      if (lone) trace.marker = { ...trace.marker, size: 7, color: trace.line.color };
    }
  }

  /** Lines that lie on one another (most of their points within half a percent of the chart's
   *  span) are drawn nested: the first widest, beneath, each next one thinner on top, so both
   *  colors show. */
  function nestOverlaps(el) {
    const lines = el.data.filter((t) => t.meta && t.meta.part === "y" && t.line && !t.stackgroup);
    const values = lines.flatMap((t) => t.y.filter((v) => v !== null && v !== undefined));
    const span = values.length ? Math.max(...values) - Math.min(...values) || Math.abs(values[0]) || 1 : 1;
    for (const t of lines) {
      if (!baseWidth.has(t)) baseWidth.set(t, t.line.width || 1.7);
      t.line.width = baseWidth.get(t);
    }
    for (let i = 0; i < lines.length; i += 1) {
      let under = 0; // how many later lines lie on this one
      for (let j = i + 1; j < lines.length; j += 1) if (overlap(lines[i], lines[j], span * 0.005)) under += 1;
      if (under) lines[i].line.width = baseWidth.get(lines[i]) + 1.6 * under;
    }
  }

  function overlap(a, b, tolerance) {
    if (a.x.length < 2 || a.x.length !== b.x.length) return false;
    let same = 0;
    for (let k = 0; k < a.y.length; k += 1) {
      if (a.y[k] !== null && b.y[k] !== null && Math.abs(a.y[k] - b.y[k]) <= tolerance) same += 1;
    }
    return same >= a.y.length / 2;
  }

  /** The server's y axes, on a log scale when the view asks (a fixed 0…1 range and the
   *  "include 0…1" rule do not apply on a log axis), and the page's shared step range. */
  function applyAxes(el) {
    const base = baseAxes.get(el);
    for (const name of ["yaxis", "yaxis2"]) {
      if (!base[name]) continue;
      const axis = { ...base[name] };
      if (view.log) {
        delete axis.range;
        delete axis.autorangeoptions;
        delete axis.rangemode;
        Object.assign(axis, { type: "log", autorange: true });
      } else if (name === "yaxis" && el.flat && !el.layout.yaxis2 && !axis.range && !axis.autorangeoptions) {
        Object.assign(axis, { range: flatRange(el.flat.values), autorange: false });
      }
      el.layout[name] = axis;
    }
    if (stepRange && !el.zoomed) {
      el.layout.xaxis = { ...el.layout.xaxis, range: [stepRange[0] - 0.5, stepRange[1] + 0.5], autorange: false };
    }
  }

  /** The page's display rules (server chart_data.chart_view, on the controls' element). */
  function rules() {
    const data = (document.getElementById("chart-controls") || {}).dataset || {};
    return {
      smoothing: Number(data.smoothing) || 0,
      smoothPast: Number(data.smoothPastSteps) || Infinity,
      foldMin: Number(data.foldMinPoints) || 2,
    };
  }

  /** The step range every chart of the page shows (until the reader zooms). A page past the
   *  rules' number of steps opens smoothed, unless its URL says how to smooth. */
  function setStepRange(first, last) {
    if (!(Number.isFinite(first) && Number.isFinite(last) && last >= first)) return;
    stepRange = [first, last];
    const { smoothing, smoothPast } = rules();
    if (view.auto && !view.smooth && last - first + 1 > smoothPast && smoothing) {
      view.smooth = smoothing;
      showView();
      for (const el of drawnEls) redraw(el);
    }
  }

  /** The controls as the view is: slider, its value, and the note while the default applies. */
  function showView() {
    const slider = document.getElementById("smoothing");
    if (!slider) return;
    slider.value = String(view.smooth);
    document.getElementById("smoothing-value").textContent = String(view.smooth);
    document.getElementById("log-scale").checked = view.log;
    const note = document.getElementById("smoothing-note");
    if (note) note.hidden = !(view.auto && view.smooth);
    document.body.dataset.view = `${view.smooth}:${view.log ? 1 : 0}`;
  }

  /** Wire the page's chart controls (partial _chart_controls.html) to the view. */
  function controls() {
    const slider = document.getElementById("smoothing");
    const log = document.getElementById("log-scale");
    if (!slider) return;
    showView();
    const apply = (event) => {
      if (event.target === slider) view.auto = false; // the reader chose: kept in the URL
      view.smooth = Number(slider.value) >= 0.01 ? Number(slider.value) : 0;
      view.log = log.checked;
      writeView();
      showView();
      for (const el of drawnEls) redraw(el);
    };
    slider.addEventListener("input", apply);
    log.addEventListener("change", apply);
  }

  // --- folding charts whose series never changed ---------------------------------------------

  // Trace names are HTML-escaped for Plotly (figures.plotly_text): a textarea decodes the
  // entities (its content is RCDATA: no element is ever created) and the text goes out as text.
  const decoder = document.createElement("textarea");

  function plain(text) {
    decoder.innerHTML = text || "";
    return decoder.value;
  }

  function short(v) {
    const n = Number(v);
    return Number.isInteger(n) ? String(n) : Number(n.toPrecision(3)).toString();
  }

  /** {text: "name = 0.5 · other = 1: constant over steps 1–30", values} when every series of
   *  the chart that has data kept one value (to 4 significant digits) over at least the rules'
   *  number of points (raw values, not smoothed; a bucket or an evaluation is one point); else
   *  null. */
  function flatSummary(el) {
    if (!hasData(el)) return null;
    const { foldMin } = rules();
    const parts = [];
    const values = [];
    let first = Infinity;
    let last = -Infinity;
    for (const trace of el.data) {
      const meta = trace.meta || {};
      if (!(meta.part === "y" || meta.part === "center")) continue;
      const ys = (meta.part === "y" ? rawOf(trace).y : trace.y).filter((v) => v !== null && v !== undefined);
      if (!ys.length) continue;
      if (ys.length < foldMin) return null; // too few points to call it constant
      const lo = Math.min(...ys);
      const hi = Math.max(...ys);
      // Unchanged to display precision (a probability of 0.99998 ± 1e-6 is a flat line at 1).
      if (hi - lo > 1e-4 * Math.max(Math.abs(hi), Math.abs(lo))) return null;
      // A bucket's marker sits at its centre: the steps it covers are its segment's ends.
      const rows = meta.part === "center" && el.buckets ? [...el.buckets.values()] : null;
      const xs = rows ? rows.flatMap((r) => [r.x0, r.x1]) : trace.x.filter((x, i) => trace.y[i] !== null && x !== null);
      first = Math.min(first, ...xs);
      last = Math.max(last, ...xs);
      const name = el.figure && el.figure.small ? "" : `${plain(nameOf(trace))} = `;
      parts.push(`${name}${short(ys[0])}`);
      values.push(ys[0]);
    }
    if (!parts.length || !(last > first)) return null;
    return { text: `${parts.join(" · ")}: constant over steps ${first}–${last}`, values };
  }

  /** A y range that shows a constant line for what it is (Plotly's own centres 0.0003 on
   *  −0.5…0.5): from 0 to twice the value, or about it when the values straddle 0. */
  function flatRange(values) {
    const lo = Math.min(...values);
    const hi = Math.max(...values);
    if (lo >= 0) return [0, hi > 0 ? hi * 2 : 1];
    if (hi <= 0) return [lo * 2, 0];
    return [lo * 1.5, hi * 1.5];
  }

  function fold(el) {
    const figure = el.closest("figure");
    const summary = figure.querySelector(".flat-summary");
    if (!summary) return;
    const text = el.flat ? el.flat.text : null;
    figure.classList.toggle("flat", text !== null);
    summary.hidden = text === null;
    if (text !== null) summary.querySelector(".flat-text").textContent = text;
  }

  /** "2 charts folded (Loss, KL): …", naming the folded charts and the rule that folded them. */
  function countFlat() {
    const counter = document.getElementById("flat-count");
    if (!counter) return;
    const titles = [...document.querySelectorAll("figure.flat")].map((f) => f.querySelector(".chart-title").firstChild.textContent.trim());
    const n = titles.length;
    const named = titles.length > 4 ? `${titles.slice(0, 4).join(", ")}, …` : titles.join(", ");
    counter.textContent = n
      ? `${n} chart${n === 1 ? "" : "s"} folded (${named}): each series held one value over at least ${rules().foldMin} points`
      : "";
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest && event.target.closest(".flat-toggle");
    if (!button) return;
    const figure = button.closest("figure");
    const open = figure.classList.toggle("unfolded");
    button.textContent = open ? "fold" : "show chart";
    button.setAttribute("aria-expanded", String(open));
    const el = figure.querySelector(".plot");
    if (open && el.data) Plotly.Plots.resize(el);
  });

  function draw(fig) {
    const el = document.getElementById(`fig-${fig.id}`);
    el.figure = fig;
    // As the server laid them out: Plotly writes its autorange into the layout it is given.
    baseAxes.set(el, { yaxis: { ...fig.layout.yaxis }, yaxis2: fig.layout.yaxis2 && { ...fig.layout.yaxis2 } });
    Plotly.newPlot(el, fig.data, fig.layout, CONFIG);
    drawnEls.push(el);
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
      const kept = rawOf(trace);
      trace.x = trace.x.concat(data.x);
      kept.y = kept.y.concat(data[meta.part] || data.y); // raw points: lo = hi = y
      trace.y = kept.y; // shape() smooths it for the view
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
      raw.set(trace, { y: trace.y });
    }
    return fig;
  }

  /** Merge the 25-step buckets a payload brings (by index: the last may still be filling) and
   *  draw each over the steps it holds (server charts.bucket_geometry): closed buckets as solid
   *  segments, the filling one dotted, a marker at each centre (open while partial). */
  function applyBuckets(el, buckets) {
    if (!buckets || !buckets.start.length) return false;
    const table = (el.buckets = el.buckets || new Map());
    buckets.index.forEach((index, i) => {
      const row = {};
      for (const key of Object.keys(buckets)) row[key] = buckets[key][i];
      table.set(index, row);
    });
    const rows = [...table.values()].sort((a, b) => a.index - b.index);
    let changed = false;
    for (const trace of el.data) {
      const meta = trace.meta || {};
      if (!meta.bucket) continue;
      const x = [];
      const y = [];
      const text = [];
      const symbols = [];
      for (const row of rows) {
        const v = row[meta.bucket];
        if (v === null || v === undefined) continue;
        if (meta.part === "center") {
          x.push(row.center);
          y.push(v);
          symbols.push(row.partial ? "circle-open" : "circle");
          text.push(row.partial ? `steps ${row.x0}–${row.x1} (${row.n} of ${row.end - row.start + 1} so far)` : `steps ${row.start}–${row.end}`);
        } else if ((meta.part === "partial") === Boolean(row.partial)) {
          x.push(row.x0, row.x1, null);
          y.push(v, v, null);
        }
      }
      trace.x = x;
      trace.y = y;
      if (meta.part === "center") {
        trace.customdata = text;
        trace.marker = { ...trace.marker, symbol: symbols };
      }
      changed = true;
    }
    return changed;
  }

  function hasData(el) {
    return el.data.some((t) => t.meta && (t.meta.part === "y" || t.meta.part === "center") && t.y.some((v) => v !== null && v !== undefined));
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
    el.flat = flatSummary(el);
    shape(el);
    const layout = el.layout;
    layout.datarevision = (layout.datarevision || 0) + 1;
    if (marks) {
      const kinds = (el.figure && el.figure.alerts) || [];
      layout.shapes = bandShapes(marks.bands || []).concat(alertShapes(marks.alerts || [], kinds));
      layout.annotations = alertMarkers(marks.alerts || [], kinds);
    }
    Plotly.react(el, el.data, layout, CONFIG);
    el.closest("figure").classList.toggle("no-data", !hasData(el));
    fold(el);
    countFlat();
    const last = el.figure && document.querySelector(`[data-last-of="${el.figure.id}"]`);
    if (last) last.textContent = lastValue(el);
  }

  /** "· last 0.0123" for a small chart's caption: its main trace's latest (raw) value. */
  function lastValue(el) {
    const trace = el.data.find((t) => t.meta && t.meta.part === "y");
    const ys = trace ? rawOf(trace).y.filter((v) => v !== null) : [];
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
        else if (event["xaxis.autorange"]) {
          // Reset: back to the page's shared step range, not each chart's own autorange.
          update = stepRange ? { "xaxis.range": [stepRange[0] - 0.5, stepRange[1] + 0.5] } : { "xaxis.autorange": true };
        }
        if (!update) return;
        const zoomed = !event["xaxis.autorange"];
        for (const o of group) o.zoomed = zoomed;
        group.syncing = true;
        // A reset resets the chart itself to the shared range too (Plotly autoranged it).
        const others = zoomed ? group.filter((o) => o !== el) : group;
        Promise.all(others.map((o) => Plotly.relayout(o, update))).finally(() => {
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

  return { draw, fillRuns, seriesNames, appendSeries, applyBuckets, hasData, redraw, syncX, onStepClick, controls, setStepRange, view, ALERT_COLORS };
})();
