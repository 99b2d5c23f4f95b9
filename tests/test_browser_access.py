"""The sign-in page in a real headless Chromium: with --auth the guard in front of every route still
lets the login page load and sign in, and the studio then works as usual."""
from __future__ import annotations

import pytest

from tests.ui_helpers import chromium, require_chromium, running_studio

pytestmark = pytest.mark.browser
sync_api = require_chromium()


def test_sign_in_through_the_guard(tmp_path, testdata):
    with running_studio(tmp_path, auth=("ana", "s3cret-pass")) as demo, chromium() as browser:
        page = browser.new_context(viewport={"width": 1200, "height": 800}).new_page()
        page.set_default_timeout(120_000)   # an upper bound on a loaded machine
        refused: list[str] = []
        page.on("response", lambda r: refused.append(r.url) if r.status == 401 else None)
        page.goto(demo.local_url)
        page.wait_for_selector("input[type=password]")
        # what the page asked for before signing in, and got refused, is only the sign-in check itself
        assert all("login_check" in u for u in refused), refused
        page.locator("input[type=text], input:not([type])").first.fill("ana")
        page.locator("input[type=password]").fill("wrong")
        page.locator("button[type=submit], button:has-text('Login')").first.click()
        page.wait_for_selector("text=/[Ii]ncorrect|[Ww]rong|[Ii]nvalid/")
        page.locator("input[type=text], input:not([type])").first.fill("ana")   # the form clears itself
        page.locator("input[type=password]").fill("s3cret-pass")
        page.locator("button[type=submit], button:has-text('Login')").first.click()
        page.wait_for_selector("#generate-btn")
        page.locator("#generate-btn").click()
        page.wait_for_function("document.querySelectorAll('#output-gallery img').length >= 1")
