"""The studio in a real headless Chromium (Debian's `chromium`; `make test` installs it).

The app runs in-process on a free port of 127.0.0.1 with the StyleGAN test pickles. Set
ATELIER_SCREENSHOTS=1 to write the README's screenshots to docs/screenshots/ while the tests run.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from core.pnginfo import read_png_params
from tests.ui_helpers import chromium, require_chromium, running_studio, tiny_sd_folder

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "docs" / "screenshots"
MEM_FIGURE = re.compile(r"\d+(\.\d+)? (KiB|MiB|GiB)")
TIME_FIGURE = re.compile(r"\d+(\.\d+)? (ms|s)\b")
STABLE_IDS = ("backend-select", "model-select", "generate-btn", "stop-btn", "seed-input", "prompt-input",
              "output-gallery", "perf-panel", "vram-readout", "latency-readout", "optimization-panel")

sync_api = require_chromium()
LONG = 120_000          # ms: every wait's upper bound on a loaded 2-core machine (the predicate decides)


@pytest.fixture(scope="module")
def studio(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("studio-browser"), queue_max_size=8) as demo:
        yield demo


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def open_page(browser, studio, query: str = ""):
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    page = ctx.new_page()
    page.set_default_timeout(LONG)
    page.goto(studio.local_url + query)
    page.wait_for_selector("#generate-btn")
    page.wait_for_function("document.querySelector('#device-readout') !== null"
                           " && document.querySelector('#output-gallery') !== null")
    return page


@pytest.fixture
def page(browser, studio):
    pg = open_page(browser, studio)
    yield pg
    pg.context.close()


def shot(page, name: str) -> None:
    if os.environ.get("ATELIER_SCREENSHOTS"):
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / name))


def fill(page, elem_id: str, text: str) -> None:
    page.locator(f"#{elem_id} textarea, #{elem_id} input").first.fill(text)


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def progress(page) -> str:
    return page.inner_text("#progress-box")


def wait_progress(page, pattern: str, timeout: float = 120.0) -> re.Match:
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = re.search(pattern, progress(page))
        if m:
            return m
        time.sleep(0.1)
    raise AssertionError(f"progress never matched {pattern!r}; it reads {progress(page)!r}")


def wait_step(page, at_least: int, timeout: float = 120.0) -> int:
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = re.search(r"step (\d+)/(\d+)", progress(page))
        if m and int(m.group(1)) >= at_least:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError(f"the job never reached step {at_least}; progress reads {progress(page)!r}")


def generate(page, seeds: str, n_images: int) -> None:
    fill(page, "seed-input", seeds)
    page.click("#generate-btn")
    wait_progress(page, rf"Done: {n_images} image")
    page.wait_for_function(f"document.querySelectorAll('#output-gallery img').length >= {n_images}")


# ---------------------------------------------------------------------------------------------
def visible(selector: str) -> str:
    """JS: is the first element matching `selector` shown?"""
    return f"(() => {{ const e = document.querySelector('{selector}'); return !!e && e.offsetParent !== null; }})()"


def test_stable_ids_and_backend_switch(page):
    for elem_id in STABLE_IDS:     # (the page mounts in pieces: wait for each, then it must be there)
        page.locator(f"#{elem_id}").first.wait_for(state="attached", timeout=LONG)
    page.wait_for_function(visible("#stylegan-controls"))
    assert not page.locator("#prompt-input").is_visible()
    page.wait_for_function("document.querySelector('#model-select input').value.includes('sg2_uncond_32')")
    page.locator("#backend-select label", has_text="Diffusion").click()
    page.locator("#prompt-input textarea").wait_for(state="visible")
    page.wait_for_function("!" + visible("#stylegan-controls"))
    page.wait_for_function("document.querySelector('#seed-input').innerText.includes('empty = random')")
    page.wait_for_function("!document.querySelector('#model-select input').value.includes('sg2_uncond')")
    page.locator("#backend-select label", has_text="StyleGAN").click()
    page.wait_for_function(visible("#stylegan-controls"))
    page.wait_for_function("document.querySelector('#model-select input').value.includes('sg2_uncond')")
    # the optimization panel lists the toggles; one that cannot run here is disabled with its reason
    page.locator("#optimization-panel").get_by_text("Optimization").first.click()
    page.locator("#precision-select").wait_for(state="visible")
    assert "Precision" in page.inner_text("#optimization-panel")
    if page.locator("#opt-fp8").count():
        import torch

        fp8 = page.locator("#opt-fp8 input[type=checkbox]")
        if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
            assert fp8.is_disabled() and "FP8 needs" in page.inner_text("#opt-fp8")
        import torch

        graph = page.locator("#opt-request-graph input[type=checkbox]")
        if not torch.cuda.is_available():       # the request graph: disabled with its reason off CUDA
            assert graph.is_disabled() and "CUDA graphs need a CUDA GPU" in page.inner_text("#opt-request-graph")
        assert page.locator("#opt-fuse-qkv input[type=checkbox]").is_enabled()
        if os.environ.get("ATELIER_SCREENSHOTS"):
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.locator("#optimization-panel").screenshot(path=str(SHOTS / "studio-optimization.png"))


def test_diffusion_generate_in_the_browser(page, tmp_path_factory):
    tiny = tiny_sd_folder(tmp_path_factory)
    page.locator("#backend-select label", has_text="Diffusion").click()
    page.locator("#prompt-input textarea").wait_for(state="visible")
    assert not page.locator("#prompt-drop-file").is_visible()      # the PNG drop target is never shown
    page.locator("#add-model").get_by_text("Add a model").click()
    fill(page, "add-model-input", str(tiny))
    page.click("#add-model-btn")
    page.wait_for_function(f"document.querySelector('#model-select input').value.includes('{tiny.name}')")
    fill(page, "prompt-input", "a watercolor fox in a misty forest, soft light")
    fill(page, "negative-prompt-input", "blurry, low quality")
    set_number(page, "steps-input", 8)
    set_number(page, "preview-every", 2)
    page.locator("#preview-method input").click()          # previews through the model's own VAE
    page.locator("[role=listbox] [role=option]", has_text="Full VAE").click()
    page.wait_for_function("document.querySelector('#preview-method input').value.startsWith('Full VAE')")
    size = page.locator("#size-select input")
    size.fill("64x64")
    size.press("Enter")
    size.blur()                            # a custom value commits on Enter or blur; both, on a busy box
    page.click("#seed-dice")
    page.wait_for_function("/^\\d+$/.test(document.querySelector('#seed-input textarea').value)")
    # A preview streams in while it denoises and leaves when the image is there. The tiny model can finish
    # between two polls of a busy page, so a DOM observer installed before the click records that one was
    # shown, whenever it was (polling for it missed it once in CI).
    page.evaluate("""() => {
        window.__previewSeen = false;
        const check = () => {
            const img = document.querySelector('#preview-image img');
            if (img && img.offsetParent !== null) window.__previewSeen = true;
        };
        window.__previewObserver = new MutationObserver(check);
        window.__previewObserver.observe(document.body, {subtree: true, childList: true, attributes: true});
    }""")
    page.click("#generate-btn")
    wait_progress(page, r"Done: 1 image")
    page.wait_for_function("document.querySelectorAll('#output-gallery img').length === 1")
    page.wait_for_function("!" + visible("#preview-image"))  # and leaves when the image is there
    assert page.evaluate("window.__previewSeen"), "no preview was shown while the image denoised"
    page.evaluate("window.__previewObserver.disconnect()")
    params = page.inner_text("#selected-params")
    assert "watercolor fox" in params and "diffusion" in params
    assert re.search(r'"width"\s*:\s*64', params), params
    page.wait_for_function("document.querySelector('#latency-readout').innerText.includes('denoise')")
    page.evaluate("window.scrollTo(0, 0)")
    shot(page, "studio-diffusion.png")


def test_generate_shows_images_latency_and_memory(page, browser, studio):
    generate(page, "0-7", 8)
    assert page.locator("#output-gallery img").count() >= 8
    page.wait_for_function("document.querySelector('#latency-readout').innerText.includes('total')", timeout=LONG)
    latency = page.inner_text("#latency-readout")
    assert TIME_FIGURE.search(latency), latency
    assert "synthesis" in latency and "total" in latency
    vram = page.inner_text("#vram-readout")
    assert MEM_FIGURE.search(vram), vram
    assert ("RSS" in vram) or ("allocated" in vram)       # CPU runs say what the figure is
    assert "seed" in page.inner_text("#selected-params")
    page.wait_for_function("!document.querySelector('#generate-btn').disabled")
    shot(page, "studio-stylegan.png")
    if os.environ.get("ATELIER_SCREENSHOTS"):      # the same state in Gradio's dark theme
        dark = open_page(browser, studio, query="?__theme=dark")
        try:
            generate(dark, "0-7", 8)
            dark.wait_for_function("!document.querySelector('#generate-btn').disabled")
            shot(dark, "studio-stylegan-dark.png")
        finally:
            dark.context.close()


def test_select_image_and_send_parameters_back(page):
    generate(page, "20-23", 4)
    page.locator("#output-gallery img").nth(2).click()
    page.wait_for_function("document.querySelector('#selected-params').innerText.includes('22')")
    page.keyboard.press("Escape")                          # leave the gallery's preview mode
    fill(page, "seed-input", "999")
    page.click("#send-back-btn")
    page.wait_for_function("document.querySelector('#seed-input textarea').value === '22'")
    assert page.locator("#seed-input textarea").input_value() == "22"


def test_stop_during_a_long_job_and_sessions_stay_apart(browser, studio, page):
    other = open_page(browser, studio)
    try:
        set_number(page, "sg-batch", 1)
        fill(page, "seed-input", "0-2000")
        page.click("#generate-btn")
        step = wait_step(page, 3)
        if os.environ.get("ATELIER_SCREENSHOTS"):
            step = wait_step(page, 40)                     # a few seconds of step-latency chart
            time.sleep(0.6)
            shot(page, "studio-running.png")

        # another session: sees a busy GPU but none of this job; its Stop touches nothing here
        assert "idle" in other.inner_text("#job-readout") or "No job" in other.inner_text("#job-readout")
        other.click("#stop-btn")
        later = wait_step(page, step + 3)
        assert later > step
        # its own job waits its turn, with its place in the queue; stopped while waiting, it never runs
        fill(other, "seed-input", "1500-1501")
        other.click("#generate-btn")
        wait_progress(other, r"position 1 of 1", timeout=120)
        other.click("#stop-btn")
        wait_progress(other, r"Stopped before it started", timeout=120)
        fill(other, "seed-input", "1600-1602")                # and a new one takes its place
        other.click("#generate-btn")
        wait_progress(other, r"position 1 of 1", timeout=120)

        before_stop = wait_step(page, later)
        page.click("#stop-btn")
        m = wait_progress(page, r"Stopped at step (\d+)/2001", timeout=120)    # hang guard, not a time budget
        assert before_stop <= int(m.group(1)) < 2001                          # it stopped, well before the end
        wait_progress(other, r"Done: 3 images", timeout=120)   # the GPU went to the waiting session
    finally:
        other.context.close()
    out = Path(studio.atelier_runtime.settings.output_dir)
    assert list(out.rglob("*seed1600.png")) and not list(out.rglob("*seed1500.png"))
    generate(page, "30-31", 2)                              # and the stopped session generates again
    assert page.locator("#output-gallery img").count() == 2


def test_png_info_reads_parameters_back(page, studio, testdata):
    generate(page, "42", 1)
    made = sorted(Path(studio.atelier_runtime.settings.output_dir).rglob("*seed42.png"))[-1]
    assert read_png_params(made)["seed"] == 42
    page.get_by_role("tab", name="PNG info").click()
    page.locator("#pnginfo-file input[type=file]").set_input_files(str(made))
    page.wait_for_function("document.querySelector('#pnginfo-json').innerText.includes('stylegan')")
    assert "42" in page.inner_text("#pnginfo-json")
    shot(page, "studio-pnginfo.png")
    fill(page, "seed-input", "1")
    page.click("#pnginfo-send")
    page.wait_for_function("document.querySelector('#seed-input textarea').value === '42'")

    a1111 = testdata / "pnginfo" / "a1111_v1_6.png"
    page.locator("#pnginfo-file input[type=file]").set_input_files(str(a1111))
    page.wait_for_function("document.querySelector('#pnginfo-json').innerText.includes('red fox')")
    page.click("#pnginfo-send")
    page.locator("#prompt-input textarea").wait_for(state="visible")
    assert "red fox" in page.input_value("#prompt-input textarea")
    assert page.input_value("#seed-input textarea") == "1234567890"


def test_style_mixing_tab(page):
    page.get_by_role("tab", name="Style mixing").click()
    fill(page, "mix-rows", "1,2")
    fill(page, "mix-cols", "5-7")
    page.click("#generate-btn")
    wait_progress(page, r"Done: style-mix grid")
    page.wait_for_function("document.querySelectorAll('#output-gallery img').length === 1")
    assert '"style-mix"' in page.inner_text("#selected-params") or "style-mix" in page.inner_text("#selected-params")


def test_compare_tab_shows_the_reference_and_the_toggles_side_by_side(page):
    fill(page, "seed-input", "0-1")
    page.locator("#optimization-panel").get_by_text("Optimization").first.click()
    page.get_by_role("tab", name="Compare").click()
    # every toggle off: there is nothing to compare, and the page says so (no job, no crash)
    page.click("#compare-btn")
    page.get_by_text("Nothing to compare").first.wait_for(state="visible", timeout=LONG)
    page.locator("#precision-select label", has_text="bf16").click()
    page.click("#compare-btn")
    wait_progress(page, r"Compared on cpu")
    page.wait_for_function("document.querySelector('#compare-table').innerText.includes('drift: PSNR')")
    table = page.inner_text("#compare-table")
    assert re.search(r"\d+\.\d+ dB", table) and "autocast-bf16" in table and TIME_FIGURE.search(table), table
    page.wait_for_function("document.querySelectorAll('#compare-slider img').length >= 2")
    page.wait_for_function("document.querySelector('#compare-diff img') !== null")
    assert "amplified" in page.inner_text("#compare-diff")
    page.wait_for_function("!document.querySelector('#compare-btn').disabled")
    if os.environ.get("ATELIER_SCREENSHOTS"):
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.locator("#at-results").screenshot(path=str(SHOTS / "studio-compare.png"))


def test_closing_the_tab_stops_its_job(browser, studio):
    page = open_page(browser, studio)
    set_number(page, "sg-batch", 1)
    fill(page, "seed-input", "0-2000")
    page.click("#generate-btn")
    wait_step(page, 1)
    rt = studio.atelier_runtime
    assert rt.queue.counts()[1] == 1
    page.context.close()
    t0 = time.time()
    while rt.queue.counts() != (0, 0) and time.time() - t0 < 15:
        time.sleep(0.1)
    assert rt.queue.counts() == (0, 0), "the closed tab's job kept the GPU"


def test_train_tab_starts_watches_and_stops_a_run(page, studio, tmp_path, monkeypatch):
    from tests.test_training_runs import write_tiny_dataset

    monkeypatch.setenv("OMP_NUM_THREADS", "1")      # the trainer child inherits it (2-core box)
    data = write_tiny_dataset(tmp_path)
    page.get_by_role("tab", name="Train").click()
    page.locator("#train-start-btn").wait_for(state="visible")
    assert "same GPU" in page.inner_text("#train-gpu-note")
    fill(page, "train-data", str(data))
    # pick the option from the list (typed text + Enter can leave the committed value behind on a busy box)
    page.locator("#train-preset input").click()
    page.get_by_role("option", name="tiny", exact=True).click()
    page.wait_for_function("document.querySelector('#train-preset input').value === 'tiny'")
    set_number(page, "train-batch", 8)        # the tiny preset's batch, stated: 24 images must hold a batch
    # the augmentation guards: untouched they say "the preset's"; the upright pipe picked from the list
    assert page.locator("#train-aug-pipe input").input_value() == "preset's"
    assert page.locator("#train-ada-max-p input[type=number]").input_value() == "0"
    assert not page.locator("#train-retune input").is_checked()
    page.locator("#train-aug-pipe input").click()
    page.get_by_role("option", name="upright", exact=True).click()
    page.wait_for_function("document.querySelector('#train-aug-pipe input').value === 'upright'")
    set_number(page, "train-kimg", 50)
    page.locator("#train-more").get_by_text("Monitor and logging").click()
    set_number(page, "train-monitor-kimg", 0.016)
    set_number(page, "train-log-every", 1)
    fill(page, "train-name", "browser-run")
    page.click("#train-start-btn")

    try:
        page.wait_for_function("/training:|failed/.test(document.querySelector('#train-status').innerText)",
                               timeout=120_000)
    except sync_api.TimeoutError:
        raise AssertionError(f"the run never reported; status: {page.inner_text('#train-status')!r}") from None
    assert "training:" in page.inner_text("#train-status"), page.inner_text("#train-status")
    kimg = "parseFloat(document.querySelector('#train-status').innerText.match(/kimg\\s+([\\d.]+)/)[1])"
    first = page.evaluate(kimg)
    page.wait_for_function(f"{kimg} > {first}", timeout=LONG)           # the timer keeps it live
    # the loss plot draws one line per series (G, D), the monitor plot its diversity curve
    page.wait_for_function("document.querySelectorAll('#train-loss-plot .mark-line path').length >= 2"
                           " && [...document.querySelectorAll('#train-loss-plot .mark-line path')]"
                           ".every(p => (p.getAttribute('d') || '').split('L').length > 3)", timeout=LONG)
    page.wait_for_function("document.querySelectorAll('#train-monitor-plot .mark-line path').length >= 1")
    page.wait_for_function("document.querySelector('#train-run-select input').value === 'browser-run'")
    req = studio.atelier_training.status("browser-run").request
    assert (req["aug_pipe"], req["ada_max_p"], req["retune"]) == ("upright", 0.0, False)
    if os.environ.get("ATELIER_SCREENSHOTS"):        # the screenshot shows the monitor's warnings when it has some
        try:
            page.wait_for_function("document.querySelector('#train-warnings').innerText.includes('kimg')",
                                   timeout=LONG)
        except sync_api.TimeoutError:
            pass

    page.click("#train-stop-btn")
    page.wait_for_function("document.querySelector('#train-status').innerText.includes('checkpoint saved')",
                           timeout=LONG)
    page.wait_for_function("document.querySelector('#train-samples img') !== null")   # the final grid
    if os.environ.get("ATELIER_SCREENSHOTS"):
        time.sleep(1.0)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.mouse.move(0, 0)
        page.screenshot(path=str(SHOTS / "studio-train.png"), full_page=True)

    fill(page, "train-data", str(tmp_path / "missing"))                   # bad input: a message, not a crash
    page.click("#train-start-btn")
    page.get_by_text("training data not found").first.wait_for(timeout=LONG)
    # the Classes accordion opens on its fields (what they send is tested through the handler,
    # tests/test_train_tab_aug.py: a typed value racing the Start click on a busy box made this flaky in CI)
    page.locator("#train-classes").get_by_text("Classes (conditional)").click()
    for elem, label in (("train-cond", "Class key"), ("train-labels", "Labels file"),
                        ("train-class-balance", "Class balance"), ("train-noisy-twins", "NoisyTwins weight"),
                        ("train-noisy-twins-sigma", "Twins noise")):
        page.locator(f"#{elem} textarea, #{elem} input").first.wait_for(state="visible", timeout=LONG)
        assert label in page.inner_text(f"#{elem}")
    # and so does "Start from a trained generator" (what it sends: tests/test_training_runs_init_g.py)
    page.locator("#train-init").get_by_text("Start from a trained generator").click()
    for elem, label in (("train-init-g", "Generator"), ("train-freeze-g-kimg", "Train D alone first (kimg)")):
        page.locator(f"#{elem} input").first.wait_for(state="visible", timeout=LONG)
        assert label in page.inner_text(f"#{elem}")


def test_closing_a_tab_whose_job_waits_gives_its_place_up(browser, studio):
    """A tab that closes while its job waits behind another tab's: Gradio drops the queued event, and the
    studio's queue board lets the place go (it would otherwise stay taken, counted against --queue-size)."""
    rt = studio.atelier_runtime
    rt.queue.wait_for(lambda w, r: (w, r) == (0, 0), timeout=120)   # woken on every queue change
    assert rt.queue.counts() == (0, 0), rt.queue.counts()
    runner = open_page(browser, studio)
    set_number(runner, "sg-batch", 1)
    fill(runner, "seed-input", "0-2000")
    runner.click("#generate-btn")
    wait_step(runner, 1)
    waiter = open_page(browser, studio)
    set_number(waiter, "sg-batch", 1)
    fill(waiter, "seed-input", "5")
    waiter.click("#generate-btn")
    rt.queue.wait_for(lambda w, r: (w, r) == (1, 1), timeout=120)   # woken on every queue change
    assert rt.queue.counts() == (1, 1), rt.queue.counts()
    waiter.context.close()
    rt.queue.wait_for(lambda w, r: (w, r) == (0, 1), timeout=120)   # woken on every queue change
    assert rt.queue.counts() == (0, 1), "the closed tab's waiting job kept its place in the queue"
    runner.click("#stop-btn")
    rt.queue.wait_for(lambda w, r: (w, r) == (0, 0), timeout=120)   # woken on every queue change
    assert rt.queue.counts() == (0, 0), rt.queue.counts()
    runner.context.close()


def pick(page, elem_id: str, typed: str, option_text: str) -> None:
    """Choose a dropdown option by typing into its filter and clicking the option that shows `option_text`."""
    box = page.locator(f"#{elem_id} input").first
    box.click()
    box.fill(typed)
    page.locator("[role=listbox] [role=option]", has_text=option_text).first.click()


def test_class_dropdown_lists_a_conditional_models_classes(page):
    """The bundled emoji64 is class-conditional and names its classes: picking it fills the Class box with
    them ("32 · animal-mammal"), a picked class reaches the job, and each result's caption names it."""
    pick(page, "model-select", "emoji64", "emoji64")
    pick(page, "class-input", "mammal", "animal-mammal")
    page.wait_for_function("document.querySelector('#class-input input').value.includes('animal-mammal')")
    generate(page, "3-4", 2)
    page.wait_for_function("[...document.querySelectorAll('#output-gallery .caption-label')]"
                           ".filter(e => e.innerText.includes('animal-mammal')).length >= 2")
    captions = page.locator("#output-gallery .caption-label").all_inner_texts()
    assert sum("animal-mammal" in c for c in captions) >= 2, captions
    page.locator("#output-gallery img").first.click()
    page.wait_for_function("document.querySelector('#selected-params').innerText.includes('animal-mammal')")
    params = page.inner_text("#selected-params")
    assert re.search(r'"class_index"\s*:\s*32', params), params
    # ψ pulls towards the class's own mean by default; the ψ centre radio next to the slider asks for the global one
    assert re.search(r'"truncation_centre"\s*:\s*"class"', params), params
    page.locator("#psi-centre label", has_text="Global").click()
    fill(page, "seed-input", "5")
    page.click("#generate-btn")
    wait_progress(page, r"Done: 1 image")
    page.wait_for_function("[...document.querySelectorAll('#output-gallery .caption-label')]"
                           ".some(e => e.innerText.includes('seed 5'))")
    page.locator("#output-gallery img").first.click()
    page.wait_for_function("document.querySelector('#selected-params').innerText.includes('\"global\"')")
