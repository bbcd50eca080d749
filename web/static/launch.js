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
  // The defaults that depend on the model and the turns (the server's
  // launch_fields.DEFAULTS_BY_RECIPE): a single reply's 8 tokens cannot hold a call, its result
  // and an answer, and a pretrained model trains at 1e-5, not the tiny model's 3e-4. Switching
  // the model or the turns swaps a field still at the old default (or empty) to the new one and
  // updates its "default N"; a value the user typed stays. The note on a model this launch
  // would build first follows the turns.
  const turns = form.elements.namedItem("turns");
  const model = form.elements.namedItem("model");
  function recipe() {
    const chosen = turns && "value" in turns ? turns.value : "single";
    const kind = model && "value" in model && model.value.trim() !== "tiny" ? "pretrained" : "tiny";
    return { key: `${kind}/${chosen}`, turns: chosen };
  }
  let shown = recipe().key;
  function showRecipe() {
    const now = recipe();
    for (const span of form.querySelectorAll(".field-default[data-by-recipe]")) {
      const defaults = JSON.parse(span.dataset.byRecipe);
      const input = form.elements.namedItem(span.dataset.field);
      if (input && "value" in input && now.key !== shown) {
        const typed = input.value.trim();
        if (typed === "" || typed === defaults[shown]) input.value = defaults[now.key];
      }
      if (defaults[now.key] !== undefined) span.textContent = `default ${defaults[now.key]}`;
    }
    for (const note of form.querySelectorAll(".model-build")) note.hidden = note.dataset.turns !== now.turns;
    shown = now.key;
  }
  if (turns) turns.addEventListener("change", showRecipe);
  if (model) model.addEventListener("input", showRecipe);
  showRecipe();
  // One launch per click: a second submit while the first is on its way would queue twice.
  form.addEventListener("submit", () => {
    const button = document.getElementById("launch-button");
    setTimeout(() => (button.disabled = true), 0);
  });
})();
