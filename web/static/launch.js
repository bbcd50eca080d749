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
  if (turns && budget && "value" in turns && "value" in budget) {
    const defaults = { single: "8", multi: "128" }; // RunConfig's default and MULTI_TURN_TOKENS
    turns.addEventListener("change", () => {
      const other = turns.value === "multi" ? defaults.single : defaults.multi;
      if (budget.value.trim() === other || budget.value.trim() === "") budget.value = defaults[turns.value] || budget.value;
    });
  }
  // One launch per click: a second submit while the first is on its way would queue twice.
  form.addEventListener("submit", () => {
    const button = document.getElementById("launch-button");
    setTimeout(() => (button.disabled = true), 0);
  });
})();
