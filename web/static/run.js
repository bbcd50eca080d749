"use strict";
// The run page: fill the charts from the series API, then follow a training run with a cursor.
(() => {
  const page = RL.pageData();
  const C = RL.charts;
  const figs = [...page.figures.main, ...page.figures.structure, ...page.figures.optimization];
  const otherFigs = page.figures.other.flatMap((group) => group.figures);
  const drawn = figs.map(C.draw);
  const names = C.seriesNames(figs);
  const axisGroup = [];
  let otherEls = [];
  let cursor = 0;
  const alerts = [];

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
    alerts.push(...fresh);
    const list = document.getElementById("alert-list");
    list.replaceChildren(
      ...alerts.map((a) => {
        const li = document.createElement("li");
        const mark = document.createElement("span");
        mark.className = `alert-kind kind-${a.kind}`;
        mark.textContent = a.kind.replaceAll("_", " ");
        const link = document.createElement("a");
        link.href = `${page.steps}/${a.step}`;
        link.textContent = `step ${a.step}`;
        li.append(mark, link, document.createTextNode(` ${a.message}`));
        return li;
      }),
    );
    document.getElementById("alerts").hidden = alerts.length === 0;
  }

  function apply(els, payload) {
    for (const el of els) {
      C.appendSeries(el, payload);
      C.applyBuckets(el, payload.buckets);
      C.redraw(el, alerts);
    }
  }

  function noteDownsampling(payload) {
    if (payload.bucket <= 1) return;
    document.getElementById("downsample-note").textContent =
      `This run is long: each point is the mean of ${payload.bucket} steps and the band their min–max, so spikes stay visible.`;
    const link = document.getElementById("full-link");
    if (link) link.hidden = false;
  }

  function showProgress(run) {
    RL.updateRunFields(document, run);
    const error = document.getElementById("run-error");
    if (run.error) {
      error.textContent = run.error;
      error.hidden = false;
    }
    document.getElementById("live").hidden = !run.active;
  }

  const openStep = (step) => (window.location.href = `${page.steps}/${step}`);

  async function poll() {
    try {
      const wanted = otherEls.length ? names.concat(C.seriesNames(otherFigs)) : names;
      const since = cursor;
      const payload = await RL.getJSON(seriesUrl(wanted, since));
      cursor = payload.cursor;
      if (cursor > since) showAlerts(await RL.getJSON(url(page.alerts, { since: String(since) })));
      apply(drawn.concat(otherEls), payload);
      showProgress(payload.run);
      if (!payload.run.active) return; // finished: that was the last update
    } catch (err) {
      console.warn("live update failed, retrying", err);
    }
    setTimeout(poll, document.hidden ? page.poll_ms * 5 : page.poll_ms);
  }

  async function start() {
    const payload = await RL.getJSON(seriesUrl(names, 0));
    cursor = payload.cursor;
    apply(drawn, payload);
    noteDownsampling(payload);
    showProgress(payload.run);
    C.syncX(axisGroup, drawn);
    for (const el of drawn) C.onStepClick(el, openStep);
    document.body.dataset.chartsReady = "true";
    showAlerts(await RL.getJSON(url(page.alerts, { since: "0" })));
    for (const el of drawn) C.redraw(el, alerts);
    if (payload.run.active) setTimeout(poll, page.poll_ms);
  }

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
