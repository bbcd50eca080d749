"use strict";
// Compare: overlaid charts with a shared step axis; one step control drives both step cards.
(() => {
  const page = RL.pageData();
  const C = RL.charts;
  C.setStepRange(1, page.max_step || 1);
  const els = page.figures.map((fig) => C.draw(C.fillRuns(fig, page.series)));
  for (const el of els) C.redraw(el); // the view (smoothing, log scale, shared steps), folding
  C.controls();
  C.syncX([], els);

  const slider = document.getElementById("cmp-slider");
  const input = document.getElementById("cmp-step");
  const bodies = [...document.querySelectorAll(".pair-body")];
  let step = page.step;
  let request = 0;

  function missing(body, s) {
    const p = document.createElement("p");
    p.className = "muted missing";
    const last = Number(body.dataset.last);
    p.textContent = `Run #${body.dataset.run} has no step ${s}` + (last ? ` (it recorded up to step ${last}).` : ".");
    body.replaceChildren(p);
  }

  /** Show step s of both runs: the cards are server-rendered (escaped) fragments. */
  async function show(s) {
    step = Math.min(Math.max(1, s), page.max_step || 1);
    slider.value = input.value = String(step);
    const url = new URL(window.location.href);
    url.searchParams.set("step", String(step));
    history.replaceState(null, "", url);
    const mine = ++request;
    await Promise.all(
      bodies.map(async (body) => {
        const group = page.group ? `?group=${page.group}` : "";
        const response = await fetch(`${page.steps[body.dataset.run]}/${step}/card${group}`);
        if (mine !== request) return; // a newer step was asked for meanwhile
        if (response.ok) body.innerHTML = await response.text();
        else missing(body, step);
      }),
    );
    document.body.dataset.pairStep = String(step);
  }

  slider.addEventListener("input", () => (input.value = slider.value));
  slider.addEventListener("change", () => show(Number(slider.value)));
  input.addEventListener("change", () => show(Number(input.value)));
  document.getElementById("cmp-prev").addEventListener("click", () => show(step - 1));
  document.getElementById("cmp-next").addEventListener("click", () => show(step + 1));
  document.addEventListener("keydown", (event) => {
    if (RL.isTyping(event) || RL.hasModifier(event)) return;
    if (event.key === "ArrowLeft") show(step - 1);
    if (event.key === "ArrowRight") show(step + 1);
  });
  for (const el of els) C.onStepClick(el, (s) => {
    show(s);
    document.getElementById("side-by-side").scrollIntoView({ behavior: "smooth" });
  });
  document.body.dataset.chartsReady = "true";
})();
