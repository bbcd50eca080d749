"use strict";
// The run page: fill the charts from the series API, then follow a queued or training run:
// its progress line and buttons from /progress, new steps with a cursor, alerts, SFT bands.
(() => {
  const page = RL.pageData();
  const C = RL.charts;
  const figs = page.sections.flatMap((section) => page.figures[section.group]);
  const otherFigs = page.figures.other.flatMap((group) => group.figures);
  const drawn = figs.map(C.draw);
  const names = C.seriesNames(figs);
  const axisGroup = [];
  let otherEls = [];
  let cursor = 0;
  const marks = { alerts: [], bands: [] };
  const sftSteps = new Set();

  function url(path, params) {
    return `${path}?${new URLSearchParams(params)}`;
  }

  function seriesUrl(wanted, since, until) {
    const params = { names: wanted.join(","), since: String(since) };
    if (until !== undefined) params.until = String(until);
    if (page.full) params.full = "1";
    return url(page.series, params);
  }

  function showAlerts(fresh) {
    marks.alerts.push(...fresh);
    document.getElementById("alert-list").replaceChildren(...marks.alerts.map(RL.alertItem));
    document.getElementById("alert-count").textContent = String(marks.alerts.length);
    const warnings = marks.alerts.filter((a) => a.severity === "warning").length;
    const counter = document.getElementById("warning-count");
    counter.textContent = `${warnings} warning${warnings === 1 ? "" : "s"}`;
    counter.dataset.warnings = String(warnings);
    document.getElementById("alerts").hidden = marks.alerts.length === 0;
  }

  /** SFT phases from the sft/loss series: a phase recorded at step s ran after step s
   *  (sft_then_rl records its phase at step 1: it ran before it). */
  function collectBands(payload) {
    const sft = page.sft_series && payload.series[page.sft_series];
    if (!sft) return;
    for (const step of sft.x) sftSteps.add(step);
    const shift = page.sft_before_rl ? -1 : 0;
    marks.bands = [...sftSteps].sort((a, b) => a - b).map((s) => [s + shift, s + shift + 1]);
  }

  function apply(els, payload) {
    collectBands(payload);
    if (cursor > 0) C.setStepRange(page.first_step || 1, cursor);
    for (const el of els) {
      C.appendSeries(el, payload);
      C.applyBuckets(el, payload.buckets);
      C.redraw(el, marks);
    }
    if (cursor > 0) {
      document.getElementById("no-steps")?.setAttribute("hidden", "");
      document.getElementById("step-viewer-link")?.removeAttribute("hidden");
    }
  }

  function noteDownsampling(payload) {
    if (payload.bucket <= 1) return;
    document.getElementById("downsample-note").textContent =
      `This run is long: each point is the mean of ${payload.bucket} steps and the band their min–max, so spikes stay visible.`;
    const link = document.getElementById("full-link");
    if (link) link.hidden = false;
  }

  /** Status, step, queue place, speed, ETA, error and which buttons apply (text only). */
  function showProgress(live) {
    RL.updateRunFields(document, live);
    document.getElementById("run-live").textContent = live.summary;
    if (live.error) {
      document.getElementById("run-error").textContent = live.error;
      document.getElementById("run-error-box").hidden = false;
    }
    document.getElementById("cancel-form").hidden = !live.can_cancel;
    document.getElementById("resume-form").hidden = !live.can_resume;
    document.getElementById("delete-form").hidden = live.status === "running";
    document.getElementById("live").hidden = !live.active;
    document.body.dataset.status = live.status;
  }

  const openStep = (step) => (window.location.href = `${page.steps}/${step}`);

  async function fetchNewSteps() {
    if (page.no_steps) {
      // Which charts a run has (control tokens, probes, states…) is known from its first step:
      // a page opened before it comes back with them all.
      window.location.reload();
      return;
    }
    const wanted = otherEls.length ? names.concat(C.seriesNames(otherFigs)) : names;
    const since = cursor;
    const payload = await RL.getJSON(seriesUrl(wanted, since));
    cursor = payload.cursor;
    if (cursor > since) showAlerts(await RL.getJSON(url(page.alerts, { since: String(since) })));
    apply(drawn.concat(otherEls), payload);
  }

  async function poll() {
    try {
      const live = await RL.getJSON(page.progress);
      // Steps first, then the status: a finished run's last steps are on the charts by the
      // time the page says it finished.
      if (live.current_step > cursor || !live.active) await fetchNewSteps();
      showProgress(live);
      if (!live.active) return; // finished: that was the last update
    } catch (err) {
      console.warn("live update failed, retrying", err);
    }
    setTimeout(poll, document.hidden ? page.poll_ms * 5 : page.poll_ms);
  }

  async function start() {
    C.controls();
    if (page.no_steps) for (const f of document.querySelectorAll("figure[data-empty]")) f.dataset.empty = "no steps yet";
    const payload = await RL.getJSON(seriesUrl(names, 0));
    cursor = payload.cursor;
    marks.alerts = [...page.initial_alerts];
    apply(drawn, payload);
    noteDownsampling(payload);
    C.syncX(axisGroup, drawn);
    for (const el of drawn) C.onStepClick(el, openStep);
    document.body.dataset.chartsReady = "true";
    if (page.active) setTimeout(poll, page.poll_ms);
  }

  const deleteForm = document.getElementById("delete-form");
  deleteForm.addEventListener("submit", (event) => {
    if (!window.confirm(deleteForm.dataset.confirm)) event.preventDefault();
  });

  const other = document.getElementById("other-series");
  if (other) {
    other.addEventListener("toggle", async () => {
      if (!other.open || otherEls.length) return;
      otherEls = otherFigs.map(C.draw);
      const payload = await RL.getJSON(seriesUrl(C.seriesNames(otherFigs), 0, cursor));
      apply(otherEls, payload);
      C.syncX(axisGroup, otherEls);
      for (const el of otherEls) C.onStepClick(el, openStep);
    });
  }

  start().catch((err) => {
    document.getElementById("chart-note").textContent = `Charts could not load: ${err.message}`;
  });
})();
