"use strict";
// The step viewer: rollout tabs, keyboard (←/→ steps, Home/End, 0–9 rollouts, [/] groups, j/k
// overview rows), slider and jump, and the token shade (probability or log-ratio, ?shade=ratio).
(() => {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  const nav = document.getElementById("step-nav");
  const rows = [...document.querySelectorAll("#groups-table tbody tr")];
  const shadeLinks = [...document.querySelectorAll("a[data-shade]")];
  const rollouts = document.querySelector("section.rollouts");
  const shadedByRatio = () => Boolean(rollouts && rollouts.classList.contains("shade-ratio"));

  function select(index, focus = false) {
    if (!tabs[index]) return;
    tabs.forEach((tab, i) => {
      const on = i === index;
      tab.setAttribute("aria-selected", on ? "true" : "false");
      tab.tabIndex = on ? 0 : -1;
      document.getElementById(tab.getAttribute("aria-controls")).hidden = !on;
    });
    if (focus) tabs[index].focus();
    history.replaceState(null, "", `#r${index}`);
    keepTabInLinks();
  }

  const currentHash = () => (/^#r\d+$/.test(window.location.hash) ? window.location.hash : "");

  /** Step and group links carry the selected rollout and the shade, so moving keeps the same #n
   *  open and the tokens shaded as they are. */
  function keepTabInLinks() {
    for (const id of ["first-step", "prev-step", "next-step", "last-step", "prev-group", "next-group"]) {
      const link = document.getElementById(id);
      if (!link || !link.hasAttribute("href")) continue;
      const url = new URL(link.href);
      if (shadedByRatio()) url.searchParams.set("shade", "ratio");
      else url.searchParams.delete("shade");
      url.hash = currentHash();
      link.href = url.href;
    }
  }

  /** The jump box's form carries the shade (the page renders its field when it was asked for). */
  function keepShadeInJump(mode) {
    const form = document.querySelector("form.jump");
    let field = document.getElementById("jump-shade");
    if (mode === "ratio" && form && !field) {
      field = Object.assign(document.createElement("input"), { type: "hidden", name: "shade", value: "ratio", id: "jump-shade" });
      form.append(field);
    } else if (mode !== "ratio" && field) {
      field.remove();
    }
  }

  /** Shade the tokens by probability or by log-ratio at once (the links reload without JS). */
  function shade(mode) {
    rollouts.classList.toggle("shade-ratio", mode === "ratio");
    for (const link of shadeLinks) link.setAttribute("aria-current", link.dataset.shade === mode ? "true" : "false");
    const url = new URL(window.location.href);
    if (mode === "ratio") url.searchParams.set("shade", "ratio");
    else url.searchParams.delete("shade");
    keepShadeInJump(mode);
    history.replaceState(null, "", url);
    keepTabInLinks();
  }
  for (const link of shadeLinks) {
    link.addEventListener("click", (event) => {
      event.preventDefault();
      shade(link.dataset.shade);
    });
  }
  if (shadedByRatio()) keepTabInLinks();

  tabs.forEach((tab, i) => tab.addEventListener("click", () => select(i)));
  for (const chip of document.querySelectorAll("[data-tab]")) {
    chip.addEventListener("click", () => select(Number(chip.dataset.tab), true));
  }
  const fromHash = currentHash();
  if (fromHash) select(Number(fromHash.slice(2)));

  function follow(id) {
    const link = document.getElementById(id);
    if (link && link.hasAttribute("href")) window.location.href = link.href;
  }

  /** The overview's rows: j/k move the focus (to the row's group link), Enter opens it. */
  function moveRow(by) {
    const at = rows.findIndex((row) => row.contains(document.activeElement));
    const next = rows[Math.min(rows.length - 1, Math.max(0, at < 0 ? 0 : at + by))];
    if (!next) return;
    rows.forEach((row) => row.classList.toggle("current", row === next));
    next.querySelector("a.group-link").focus();
  }

  document.addEventListener("keydown", (event) => {
    if (RL.isTyping(event) || RL.hasModifier(event)) return;
    const keys = {
      ArrowLeft: "prev-step",
      ArrowRight: "next-step",
      Home: "first-step",
      End: "last-step",
      "[": "prev-group",
      "]": "next-group",
    };
    if (keys[event.key]) {
      event.preventDefault();
      follow(keys[event.key]);
    } else if (/^[0-9]$/.test(event.key) && tabs[Number(event.key)]) {
      event.preventDefault();
      select(Number(event.key), true);
    } else if ((event.key === "j" || event.key === "k") && rows.length) {
      event.preventDefault();
      moveRow(event.key === "j" ? 1 : -1);
    }
  });

  if (nav) {
    const slider = document.getElementById("step-slider");
    const input = document.getElementById("step-input");
    const group = nav.dataset.group === undefined ? "" : `&group=${nav.dataset.group}`;
    slider.addEventListener("input", () => (input.value = slider.value));
    slider.addEventListener("change", () => {
      const shaded = shadedByRatio() ? "&shade=ratio" : "";
      window.location.href = `${nav.dataset.jump}?step=${slider.value}${group}${shaded}${currentHash()}`;
    });
  }
})();
