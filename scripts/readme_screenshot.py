"""Screenshots of the studio with the bundled model for the README (headless Debian chromium).

.venv/bin/python scripts/readme_screenshot.py docs/screenshots/studio-emoji64.png
.venv/bin/python scripts/readme_screenshot.py --compare docs/screenshots/studio-compare.png   # the Compare tab, bf16
"""
from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(out: str, compare: bool = False) -> None:
    from playwright import sync_api

    from core.settings import Settings
    from pipelines.services import build_services
    from ui.studio import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp())
    settings = Settings(host="127.0.0.1", port=port, models_dirs=(), output_dir=tmp / "out", cache_dir=tmp / "cache")
    demo = serve(build_services(settings), quiet=True)
    try:
        with sync_api.sync_playwright() as p:
            b = p.chromium.launch(executable_path="/usr/bin/chromium",
                                  args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = b.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.set_default_timeout(60_000)
            page.goto(demo.local_url)
            page.wait_for_selector("#generate-btn")
            if compare:
                page.locator("#seed-input textarea, #seed-input input").first.fill("0-3")
                page.locator("#psi-input input[type=number]").fill("0.7")
                page.locator("#optimization-panel").get_by_text("Optimization").first.click()
                page.locator("#precision-select label", has_text="bf16").click()
                page.locator("#opt-channels-last label").first.click()
                page.get_by_role("tab", name="Compare").click()
                page.locator("#compare-btn").click()
                page.wait_for_function("document.querySelector('#compare-table').innerText.includes('drift: PSNR')")
                page.wait_for_timeout(1500)
                page.locator("#at-results").screenshot(path=out)
            else:
                page.locator("#seed-input textarea, #seed-input input").first.fill("0-15")
                page.locator("#generate-btn").click()
                page.wait_for_function("document.querySelectorAll('#output-gallery img').length >= 16")
                page.wait_for_timeout(1500)
                page.screenshot(path=out)
            b.close()
    finally:
        demo.close()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--compare"]
    cmp = "--compare" in sys.argv[1:]
    default = "studio-compare.png" if cmp else "studio-emoji64.png"
    main(args[0] if args else str(ROOT / "docs" / "screenshots" / default), compare=cmp)
