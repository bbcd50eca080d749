"use strict";
// Helpers shared by every page: page data, JSON fetches, live run fields, alert items.
window.RL = (() => {
  /** The JSON the server put in <script type="application/json" id=...>. */
  function pageData(id = "page-data") {
    const el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : {};
  }

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`${response.status} from ${url}`);
    return response.json();
  }

  /** Refresh every [data-field] under root from a run's progress fields (text only, never HTML):
   *  the server sends each field's text as the page shows it (run.text, server.formats). */
  function updateRunFields(root, run) {
    for (const el of root.querySelectorAll("[data-field]")) {
      const field = el.dataset.field;
      if (!(field in run)) continue;
      if (field === "status") {
        const badge = el.querySelector(".badge") || el;
        badge.textContent = run.status;
        badge.className = `badge status-${run.status}`;
        badge.dataset.status = run.status;
      } else if (run.text && field in run.text) {
        el.textContent = run.text[field];
      }
    }
    // "true acc. · last N": the last 25 steps, or all of them before there are 25.
    for (const dt of root.querySelectorAll("dt[data-window]")) {
      const window = Number(dt.dataset.window);
      const n = run.current_step > 0 ? Math.min(run.current_step, window) : window;
      dt.textContent = `${dt.dataset.label} · last ${n}`;
    }
    for (const bar of root.querySelectorAll("progress")) {
      bar.max = Math.max(run.total_steps, 1);
      bar.value = run.current_step;
    }
    for (const el of root.querySelectorAll("[data-status]:not(.badge)")) el.dataset.status = run.status;
  }

  /** Whether a key press belongs to a form field rather than to page shortcuts. */
  const isTyping = (event) =>
    event.target instanceof Element && event.target.closest("input, textarea, select, [contenteditable]") !== null;

  const hasModifier = (event) => event.altKey || event.ctrlKey || event.metaKey;

  /** One alert as a list item, from the JSON every alert comes in (kind, label, step, url,
   *  message): the same markup as the alert_item macro in macros.html. */
  function alertItem(a) {
    const li = document.createElement("li");
    li.className = `severity-${a.severity}`;
    const mark = document.createElement("span");
    mark.className = `alert-kind kind-${a.kind}`;
    mark.textContent = a.label;
    const link = document.createElement("a");
    link.href = a.url;
    link.textContent = `step ${a.step}`;
    li.append(mark, link, document.createTextNode(` ${a.message}`));
    if (a.rollouts_url) {
      const rollouts = document.createElement("a");
      rollouts.className = "alert-rollouts";
      rollouts.href = a.rollouts_url;
      rollouts.textContent = "rollouts";
      li.append(document.createTextNode(" "), rollouts);
    }
    if (a.mismatch_url) {  // a mismatch alert: its step's tokens in the drill-down
      const tokens = document.createElement("a");
      tokens.className = "alert-mismatch";
      tokens.href = a.mismatch_url;
      tokens.textContent = "tokens";
      li.append(document.createTextNode(" "), tokens);
    }
    return li;
  }

  return { pageData, getJSON, updateRunFields, alertItem, isTyping, hasModifier };
})();
