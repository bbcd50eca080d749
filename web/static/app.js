"use strict";
// Helpers shared by every page: page data, number formats, JSON fetches, live run fields.
window.RL = (() => {
  /** The JSON the server put in <script type="application/json" id=...>. */
  function pageData(id = "page-data") {
    const el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : {};
  }

  const missing = (v) => v === null || v === undefined || Number.isNaN(v);
  const num = (v, digits = 3) => (missing(v) ? "—" : Number(v).toFixed(digits));
  const money = (v) =>
    missing(v) ? "—" : "$" + Number(v).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  const minutes = (v) =>
    missing(v) ? "—" : Number(v).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
  const when = (iso) => (iso ? iso.slice(0, 16).replace("T", " ") + " UTC" : "—");

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`${response.status} from ${url}`);
    return response.json();
  }

  const FORMATS = {
    current_step: (v) => String(v),
    recent_true_accuracy: num,
    recent_reward: num,
    device_minutes: minutes,
    cost: money,
    finished_at: when,
    queue_position: (v) => (v ? `#${v} in queue` : ""),
  };

  /** Refresh every [data-field] under root from a run's progress fields (text only, never HTML). */
  function updateRunFields(root, run) {
    for (const el of root.querySelectorAll("[data-field]")) {
      const field = el.dataset.field;
      if (!(field in run)) continue;
      if (field === "status") {
        const badge = el.querySelector(".badge") || el;
        badge.textContent = run.status;
        badge.className = `badge status-${run.status}`;
        badge.dataset.status = run.status;
      } else if (FORMATS[field]) {
        el.textContent = FORMATS[field](run[field]);
      }
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

  return { pageData, num, money, minutes, when, getJSON, updateRunFields, isTyping, hasModifier };
})();
