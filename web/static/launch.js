"use strict";
// The launch form: dim the fields that do not apply to the chosen variant, verifier or signal.
(() => {
  const form = document.getElementById("launch-form");
  if (!form) return;
  const dependents = [...form.querySelectorAll("[data-when-field]")];

  function refresh() {
    for (const field of dependents) {
      const control = form.elements.namedItem(field.dataset.whenField);
      const applies = !control || !("value" in control) || field.dataset.whenValues.split(",").includes(control.value);
      field.classList.toggle("irrelevant", !applies);
      field.title = applies ? "" : `Only used when ${field.dataset.whenField} is ${field.dataset.whenValues.replaceAll(",", " or ")}`;
    }
  }

  form.addEventListener("change", refresh);
  refresh();
  // Switching turns swaps the completion budget between the two defaults (a single reply's 8
  // tokens cannot hold a call, its result and an answer); a value the user typed stays.
  const turns = form.elements.namedItem("turns");
  const budget = form.elements.namedItem("max_completion_tokens");
  // The "default N" each field's help shows follows the turns too (the server's
  // launch.DEFAULTS_BY_TURNS), and so does the note on a model this launch would build first.
  function showTurns() {
    const chosen = turns && "value" in turns ? turns.value : "single";
    for (const span of form.querySelectorAll(".field-default[data-by-turns]")) {
      const byTurns = JSON.parse(span.dataset.byTurns);
      if (byTurns[chosen] !== undefined) span.textContent = `default ${byTurns[chosen]}`;
    }
    for (const note of form.querySelectorAll(".model-build")) note.hidden = note.dataset.turns !== chosen;
  }
  if (turns && budget && "value" in turns && "value" in budget) {
    const span = form.querySelector("#help-max_completion_tokens .field-default[data-by-turns]");
    const defaults = span ? JSON.parse(span.dataset.byTurns) : { single: "8", multi: "128" };
    turns.addEventListener("change", () => {
      const other = turns.value === "multi" ? defaults.single : defaults.multi;
      if (budget.value.trim() === other || budget.value.trim() === "") budget.value = defaults[turns.value] || budget.value;
      showTurns();
    });
  }
  showTurns();
  // One launch per click: a second submit while the first is on its way would queue twice.
  form.addEventListener("submit", () => {
    const button = document.getElementById("launch-button");
    setTimeout(() => (button.disabled = true), 0);
  });
})();
