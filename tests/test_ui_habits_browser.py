"""Artist habits in a real headless Chromium (Debian's `chromium` through Playwright): Ctrl+Enter from anywhere,
a second press during a run, a PNG dropped on the prompt, the history surviving a reload, the phone layout.
The studio runs in-process on a free port of 127.0.0.1 with the StyleGAN test pickles."""
from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from tests.ui_helpers import chromium, require_chromium, running_studio

pytestmark = pytest.mark.browser

sync_api = require_chromium()
expect = sync_api.expect
LONG = 120_000          # ms: an upper bound for a wait on a loaded 2-core machine, never a time budget
expect.set_options(timeout=LONG)      # Playwright's own default is 5 s


@pytest.fixture(scope="module")
def studio(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("studio-habits-browser"), queue_max_size=8) as demo:
        yield demo


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


def open_page(browser, studio, width=1400, height=900, context=None):
    ctx = context or browser.new_context(viewport={"width": width, "height": height})
    page = ctx.new_page()
    page.set_default_timeout(LONG)
    page.goto(studio.local_url)
    page.wait_for_selector("#generate-btn")
    page.wait_for_function("document.querySelector('#device-readout') !== null"
                           " && document.querySelector('#output-gallery') !== null"
                           " && window.__atelierHabits === true")
    return page


@pytest.fixture
def page(browser, studio):
    pg = open_page(browser, studio)
    yield pg
    pg.context.close()


def fill(page, elem_id: str, text: str) -> None:
    page.locator(f"#{elem_id} textarea, #{elem_id} input").first.fill(text)


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def expect_progress(page, pattern: str, timeout: float = LONG) -> None:
    expect(page.locator("#progress-box")).to_contain_text(re.compile(pattern), timeout=timeout)


# ---------------------------------------------------------------------------------------------
def test_ctrl_enter_generates_from_anywhere_and_a_second_press_says_why_it_did_not_queue(page):
    set_number(page, "sg-batch", 1)
    fill(page, "seed-input", "0-2000")
    page.locator("#psi-input input[type=number]").focus()       # a field that has nothing to do with Generate
    page.keyboard.press("Control+Enter")
    expect_progress(page, r"step \d+/2001")
    page.evaluate("document.activeElement && document.activeElement.blur()")   # focus on no field at all
    page.keyboard.press("Control+Enter")                                       # a second press while it runs
    expect(page.locator(".toast-body").filter(has_text="Not queued")).to_be_visible(timeout=LONG)
    assert "this tab already has a job" in page.locator(".toast-body").filter(has_text="Not queued").inner_text()
    page.click("#stop-btn")
    expect_progress(page, r"Stopped at step \d+/2001")
    fill(page, "seed-input", "5-6")
    page.locator("#seed-input textarea").press("Control+Enter")
    expect_progress(page, r"Done: 2 images")
    expect(page.locator("#output-gallery img")).to_have_count(2, timeout=LONG)


def _drop_file(page, target: str, path: Path, mime: str = "image/png") -> None:
    """Drop `path` on `target` as a file dragged from the desktop would be (dragover, then drop)."""
    data = base64.b64encode(path.read_bytes()).decode()
    page.evaluate("""([sel, data, name, mime]) => {
        const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], name, { type: mime }));
        const el = document.querySelector(sel);
        el.dispatchEvent(new DragEvent("dragover", { dataTransfer: dt, bubbles: true, cancelable: true }));
        el.dispatchEvent(new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true }));
    }""", [target, data, path.name, mime])


def test_a_png_dropped_on_the_prompt_fills_the_controls_and_names_a_missing_model(page, testdata):
    page.locator("#backend-select label", has_text="Diffusion").click()
    page.locator("#prompt-input textarea").wait_for(state="visible")
    fill(page, "prompt-input", "something else")
    _drop_file(page, "#prompt-input textarea", testdata / "pnginfo" / "a1111_v1_6.png")
    expect(page.locator("#prompt-input textarea")).to_have_value(re.compile(r"^a portrait of a red fox"), timeout=LONG)
    expect(page.locator("#seed-input textarea")).to_have_value("1234567890")
    assert "empty = random" in page.inner_text("#seed-input")            # the diffusion seed label, not StyleGAN's
    expect(page.locator("#negative-prompt-input textarea")).to_have_value("blurry, lowres, watermark")
    expect(page.locator("#model-select")).to_contain_text("v1-5-pruned-emaonly", timeout=LONG)   # said, not swapped
    page.get_by_role("tab", name="PNG info").click()
    expect(page.locator("#pnginfo-json")).to_contain_text("red fox")      # the same reading as the PNG info tab


def test_history_keeps_this_browsers_results_across_runs_and_a_reload(browser, studio):
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = open_page(browser, studio, context=ctx)
        page.get_by_role("tab", name="History").click()
        page.click("#history-clear")
        expect(page.locator("#history-gallery img")).to_have_count(0, timeout=LONG)
        for seeds, n in (("40-41", 2), ("42", 1)):
            fill(page, "seed-input", seeds)
            page.click("#generate-btn")
            expect_progress(page, rf"Done: {n} image")
        expect(page.locator("#history-gallery img")).to_have_count(3, timeout=LONG)
        page.reload()
        page.wait_for_function("window.__atelierHabits === true")
        page.get_by_role("tab", name="History").click()
        expect(page.locator("#history-gallery img")).to_have_count(3, timeout=LONG)   # kept by the browser
        expect(page.locator("#output-gallery img")).to_have_count(0)                # a fresh session otherwise
        page.locator("#history-gallery img").first.click()                         # the newest first: seed 42
        expect(page.locator("#history-params")).to_contain_text("42", timeout=LONG)
        page.keyboard.press("Escape")
        fill(page, "seed-input", "7")
        page.click("#history-send")
        expect(page.locator("#seed-input textarea")).to_have_value("42", timeout=LONG)
        page.click("#history-clear")
        expect(page.locator("#history-gallery img")).to_have_count(0, timeout=LONG)
        page.reload()
        page.wait_for_function("window.__atelierHabits === true")
        page.get_by_role("tab", name="History").click()
        page.locator("#history-gallery").wait_for(state="visible")
        expect(page.locator("#history-gallery img")).to_have_count(0)
    finally:
        ctx.close()


def test_phone_width_has_generate_above_the_fold_and_a_gallery_that_fits(browser, studio):
    page = open_page(browser, studio, width=390, height=844)
    try:
        page.evaluate("window.scrollTo(0, 0)")
        box = page.locator("#generate-btn").bounding_box()
        assert box["y"] >= 0 and box["y"] + box["height"] <= 844, box           # on the first screen, unscrolled
        stop = page.locator("#stop-btn").bounding_box()
        assert stop["x"] + stop["width"] <= 390, stop
        fill(page, "seed-input", "0-7")
        page.click("#generate-btn")
        expect_progress(page, r"Done: 8 images")
        expect(page.locator("#output-gallery img")).to_have_count(8, timeout=LONG)
        page.evaluate("document.querySelector('#output-gallery').scrollIntoView()")
        for i in range(8):                                                     # every thumbnail whole in width
            b = page.locator("#output-gallery img").nth(i).bounding_box()
            assert b["x"] >= 0 and b["x"] + b["width"] <= 390, (i, b)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390     # nothing runs off to the side
    finally:
        page.context.close()


def _colours(page, selector: str) -> tuple[str, str]:
    return tuple(page.evaluate(f"() => {{ const cs = getComputedStyle(document.querySelector('{selector}'));"
                               " return [cs.color, cs.backgroundColor]; }"))


def test_stop_keeps_a_readable_label_on_hover_in_light_mode(page):
    page.hover("#stop-btn")
    page.wait_for_function("(() => { const cs = getComputedStyle(document.querySelector('#stop-btn'));"
                           " return cs.backgroundColor === 'rgb(220, 38, 38)'; })()", timeout=LONG)   # filled red
    text, background = _colours(page, "#stop-btn")
    assert text != background, (text, background)
    assert text == "rgb(255, 255, 255)"


def test_compare_with_every_toggle_off_is_a_note_not_a_failure(page):
    fill(page, "seed-input", "0-1")
    page.get_by_role("tab", name="Compare").click()
    page.click("#compare-btn")
    expect(page.locator("#compare-nothing")).to_contain_text("Nothing to compare", timeout=LONG)
    assert page.locator(".toast-body.error").count() == 0           # no red error toast
    assert "failed" not in page.inner_text("#job-readout").lower()   # and no "failed" badge


def test_a_model_added_by_folder_path_sets_its_native_size(page, tmp_path_factory):
    from tests.ui_helpers import tiny_sd_folder

    folder = tiny_sd_folder(tmp_path_factory)
    page.locator("#backend-select label", has_text="Diffusion").click()
    page.locator("#add-model").get_by_text("Add a model").click()
    fill(page, "add-model-input", str(folder))
    page.locator("#add-model-btn").click()
    expect(page.locator("#add-model-status")).to_contain_text("Added", timeout=LONG)
    expect(page.locator("#size-select input")).to_have_value("64×64", timeout=LONG)     # not the 512² preset
    expect(page.locator("#steps-input input[type=number]")).to_have_value("25")


def test_style_mix_sliders_take_the_pickles_layer_count_after_its_first_run(browser, tmp_path_factory, testdata):
    """A fresh studio whose default model is an NVlabs pickle: its layer count (8 at 32 px) is known only once
    it is loaded, so the sliders start at the most a StyleGAN takes and narrow after the first images."""
    with running_studio(tmp_path_factory.mktemp("studio-mix-layers")) as fresh:
        page = open_page(browser, fresh)
        try:
            page.get_by_role("tab", name="Style mixing").click()
            mix_to = page.locator("#mix-to input[type=range]")
            expect(mix_to).to_have_attribute("max", "18")
            page.get_by_role("tab", name="Images").click()
            fill(page, "seed-input", "0")
            page.locator("#generate-btn").click()
            expect_progress(page, r"Done")
            page.get_by_role("tab", name="Style mixing").click()
            expect(mix_to).to_have_attribute("max", "8", timeout=LONG)
            expect(page.locator("#mix-from input[type=range]")).to_have_attribute("max", "7")
        finally:
            page.context.close()


def test_the_side_panel_shows_generate_to_pixels_as_this_browser_measured_it(page):
    set_number(page, "sg-batch", 1)
    fill(page, "seed-input", "3")
    pixels = page.locator("#at-pixels")
    expect(pixels).to_contain_text("Generate → pixels")
    assert pixels.get_attribute("data-ms") is None                     # nothing measured before a press
    page.click("#generate-btn")
    expect(pixels).to_have_attribute("data-ms", re.compile(r"^\d+(\.\d)?$"), timeout=LONG)
    first = float(pixels.get_attribute("data-ms"))
    assert first > 0 and page.evaluate("window.__atelierPixelsMs") == pytest.approx(first, abs=0.1)
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", pixels.locator("b").inner_text())
    # the server's own latency for the job is part of what the browser waited for
    expect(page.locator("#latency-readout")).to_contain_text("total", timeout=LONG)
    # a second press measures again (a new image, a new value), and the readout outlives panel refreshes
    fill(page, "seed-input", "4")
    page.evaluate("document.querySelector('#at-pixels').removeAttribute('data-ms')")
    page.locator("#seed-input textarea").press("Control+Enter")
    expect(pixels).to_have_attribute("data-ms", re.compile(r"^\d+(\.\d)?$"), timeout=LONG)
    expect_progress(page, r"Done: 1 image")
    assert page.locator("#at-pixels").count() == 1
