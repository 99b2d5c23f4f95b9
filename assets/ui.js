() => {
  // Atelier studio: artist habits that need the page itself (run once per page; see docs/ui.md).
  if (window.__atelierHabits) return;
  window.__atelierHabits = true;
  const q = (sel) => document.querySelector(sel);
  const shown = (el) => !!el && el.offsetParent !== null;

  // Ctrl+Enter (⌘+Enter on a Mac) generates from anywhere on the Generate tab, inside a text field or not.
  // Captured before the fields see it, so a prompt's own Enter handling does not press Generate twice.
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || !(e.ctrlKey || e.metaKey) || e.isComposing || e.repeat) return;
    const btn = q("#generate-btn");
    if (!shown(btn)) return;                 // another tab (Train) is in front: nothing to generate there
    e.preventDefault();
    e.stopPropagation();
    btn.click();
  }, true);

  // A PNG dropped on the prompt: read its parameters into the controls, as PNG info does. The file goes to a
  // hidden upload field (#prompt-drop-file), whose upload event does the reading on the server.
  const onPrompt = (e) => !!(e.target && e.target.closest && e.target.closest("#prompt-input"));
  const carriesFile = (e) => !!e.dataTransfer && Array.from(e.dataTransfer.types || []).includes("Files");
  const mark = (on) => { const p = q("#prompt-input"); if (p) p.classList.toggle("at-drop", on); };
  document.addEventListener("dragover", (e) => {
    if (onPrompt(e) && carriesFile(e)) { e.preventDefault(); e.dataTransfer.dropEffect = "copy"; mark(true); }
  }, true);
  document.addEventListener("dragleave", (e) => { if (onPrompt(e)) mark(false); }, true);
  document.addEventListener("drop", (e) => {
    if (!onPrompt(e) || !carriesFile(e)) return;        // dropped text goes into the prompt as usual
    mark(false);
    const file = Array.from(e.dataTransfer.files).find((f) => /^image\//.test(f.type) || /\.(png|jpe?g|webp)$/i.test(f.name));
    if (!file) return;
    e.preventDefault();
    e.stopPropagation();
    const input = q("#prompt-drop-file input[type=file]");
    if (!input) return;
    const dt = new DataTransfer();
    dt.items.add(file);
    input.files = dt.files;
    input.dispatchEvent(new Event("change", { bubbles: true }));
  }, true);

  // Generate -> pixels: the time from the press (click or Ctrl+Enter) to the first result image decoded
  // in this browser (request, queue, seeds, synthesis, PNG, transfer, decode): what the artist waits for,
  // next to the server's own per-stage latency. Shown under the side panel's latency, in its own element
  // (the panel's HTML is re-rendered by the timer); the last value is also window.__atelierPixelsMs.
  let pressedAt = null;
  let seenSrc = new Set();
  document.addEventListener("click", (e) => {
    if (!e.target || !e.target.closest || !e.target.closest("#generate-btn")) return;
    pressedAt = performance.now();
    seenSrc = new Set(Array.from(document.querySelectorAll("#output-gallery img")).map((i) => i.currentSrc || i.src));
  }, true);
  const readout = () => {
    let el = q("#at-pixels");
    const anchor = q("#latency-readout");
    if (!el && anchor) {
      el = document.createElement("div");
      el.id = "at-pixels";
      el.className = "at-kv at-pixels";
      el.innerHTML = '<span>Generate \u2192 pixels (browser)</span><b>\u2013</b>';
      anchor.insertAdjacentElement("afterend", el);
    }
    return el;
  };
  const fmt = (ms) => (ms < 1000 ? `${ms.toFixed(0)} ms` : `${(ms / 1000).toFixed(2)} s`);
  const settle = (img) => {
    if (pressedAt === null) return;
    const src = img.currentSrc || img.src;
    if (!src || seenSrc.has(src)) return;
    const done = () => {
      if (pressedAt === null) return;
      const ms = performance.now() - pressedAt;
      pressedAt = null;
      window.__atelierPixelsMs = ms;
      const el = readout();
      if (el) { el.querySelector("b").textContent = fmt(ms); el.dataset.ms = ms.toFixed(1); }
    };
    if (img.complete && img.naturalWidth > 0) done(); else img.addEventListener("load", done, { once: true });
  };
  const watch = new MutationObserver(() => {
    readout();
    if (pressedAt !== null) document.querySelectorAll("#output-gallery img").forEach(settle);
  });
  watch.observe(document.body, { childList: true, subtree: true, attributes: true, attributeFilter: ["src"] });
  readout();
}
