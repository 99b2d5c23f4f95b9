"""Screenshot of the studio with the bundled model for the README (headless Debian chromium).

.venv/bin/python scripts/readme_screenshot.py docs/screenshots/studio-emoji64.png
"""
from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(out: str) -> None:
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
            page.locator("#seed-input textarea, #seed-input input").first.fill("0-15")
            page.locator("#generate-btn").click()
            page.wait_for_function("document.querySelectorAll('#output-gallery img').length >= 16")
            page.wait_for_timeout(1500)
            page.screenshot(path=out)
            b.close()
    finally:
        demo.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "docs" / "screenshots" / "studio-emoji64.png"))
