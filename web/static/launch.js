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
  // One launch per click: a second submit while the first is on its way would queue twice.
  form.addEventListener("submit", () => {
    const button = document.getElementById("launch-button");
    setTimeout(() => (button.disabled = true), 0);
  });
})();
