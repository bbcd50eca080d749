"use strict";
// The runs page (one page of runs): filter this page as you type (Enter searches every run),
// pick runs to compare, follow this page's training runs live and say when new runs appear.
(() => {
  const page = RL.pageData();
  const table = document.getElementById("runs-table");
  const rows = table ? [...table.tBodies[0].rows] : [];
  const filter = document.getElementById("run-filter");
  const button = document.getElementById("compare-button");
  const form = document.getElementById("compare-form");

  function applyFilter() {
    const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    let shown = 0;
    for (const row of rows) {
      const match = words.every((w) => row.dataset.search.includes(w));
      row.hidden = !match;
      if (match) shown += 1;
    }
    const empty = document.getElementById("filter-empty");
    if (empty) empty.hidden = shown > 0;
  }

  const selected = () => (form ? [...form.querySelectorAll('input[name="runs"]:checked')].map((c) => c.value) : []);

  function updateSelection() {
    if (!button) return;
    const ids = selected();
    button.disabled = ids.length < 2;
    document.getElementById("selected-count").textContent = ids.length ? `${ids.length} runs` : "selected";
    button.title = ids.length < 2 ? "Select two or more runs" : `Compare runs ${ids.join(", ")}`;
    for (const row of rows) row.classList.toggle("selected", row.querySelector('input[name="runs"]').checked);
  }

  if (filter && rows.length) filter.addEventListener("input", applyFilter);
  if (form) {
    form.addEventListener("change", updateSelection);
    form.addEventListener("submit", (event) => {
      // One readable URL, /compare?runs=3,7, instead of runs=3&runs=7.
      event.preventDefault();
      const ids = selected();
      if (ids.length >= 2) window.location.href = `${form.action}?runs=${ids.join(",")}`;
    });
    updateSelection();
  }

  const active = new Set(page.active);
  let newest = page.newest; // the newest run matching this search, on this page or not
  const fresh = new Set(); // runs newer than the page, since it loaded

  /** A "⚠ n" badge that opens the run's alerts, each a link to the step where it fired. */
  function alertBadge(alerts) {
    const details = document.createElement("details");
    details.className = "alert-badge";
    const summary = document.createElement("summary");
    const warnings = alerts.filter((a) => a.severity === "warning").length;
    summary.textContent = warnings ? `⚠ ${warnings}` : `ℹ ${alerts.length}`;
    summary.title = `${alerts.length} alert${alerts.length === 1 ? "" : "s"}: ${[...new Set(alerts.map((a) => a.label))].join(", ")}`;
    const list = document.createElement("ul");
    list.append(...alerts.map(RL.alertItem));
    details.append(summary, list);
    return details;
  }

  const alertedAt = new Map(); // run id → the step its badge was computed at

  async function loadAlerts(ids) {
    if (!ids.length) return;
    try {
      const byRun = await RL.getJSON(`${page.alerts}?runs=${ids.join(",")}`);
      for (const [id, alerts] of Object.entries(byRun)) {
        const slot = table && table.querySelector(`[data-alerts-for="${id}"]`);
        if (slot) slot.replaceChildren(...(alerts.length ? [alertBadge(alerts)] : []));
      }
    } catch (err) {
      console.warn("alerts could not load", err);
    }
  }

  const listed = rows.map((row) => Number(row.dataset.runId));
  for (let i = 0; i < listed.length; i += 100) loadAlerts(listed.slice(i, i + 100));

  async function poll() {
    try {
      // This page's training runs, and any run newer than the newest matching one.
      const params = new URLSearchParams({ after: String(newest), per_page: String(page.poll_size) });
      if (active.size) params.set("ids", [...active].join(","));
      if (page.q) params.set("q", page.q);
      const { runs } = await RL.getJSON(`${page.api}?${params}`);
      const moved = [];
      for (const run of runs) {
        const row = table && table.querySelector(`tr[data-run-id="${run.id}"]`);
        if (row) {
          RL.updateRunFields(row, run);
          const finished = !["queued", "running"].includes(run.status);
          if (finished) active.delete(run.id);
          // Alerts of a training run: again every 10 steps and once when it ends.
          const seen = alertedAt.get(run.id) ?? 0;
          if (finished || run.current_step - seen >= 10) {
            alertedAt.set(run.id, run.current_step);
            if (run.current_step > 0) moved.push(run.id);
          }
        } else if (run.id > page.newest) {
          fresh.add(run.id);
        }
      }
      loadAlerts(moved);
      if (fresh.size) {
        if (document.getElementById("empty-state")) return window.location.reload();
        const banner = document.getElementById("new-runs");
        document.getElementById("new-runs-text").textContent =
          fresh.size === 1 ? "1 new run." : `${fresh.size} new runs.`;
        banner.hidden = false;
        newest = Math.max(newest, ...fresh);
      }
    } catch (err) {
      console.warn("runs update failed, retrying", err);
    }
    const slow = document.hidden || active.size === 0;
    setTimeout(poll, slow ? page.poll_ms * 3 : page.poll_ms);
  }

  setTimeout(poll, page.poll_ms);
})();
