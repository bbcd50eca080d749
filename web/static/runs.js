"use strict";
// The runs page: filter as you type, pick runs to compare, follow training runs live.
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
    document.getElementById("run-count").textContent = String(shown);
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
  let newest = page.newest;
  const fresh = new Set();

  async function poll() {
    try {
      const params = new URLSearchParams({ after: String(newest) });
      if (active.size) params.set("ids", [...active].join(","));
      if (page.q) params.set("q", page.q);
      const runs = await RL.getJSON(`${page.api}?${params}`);
      for (const run of runs) {
        const row = table && table.querySelector(`tr[data-run-id="${run.id}"]`);
        if (row) {
          RL.updateRunFields(row, run);
          if (!["queued", "running"].includes(run.status)) active.delete(run.id);
        } else if (run.id > page.newest) {
          fresh.add(run.id);
        }
      }
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
