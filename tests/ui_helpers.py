"""Start the studio in-process on a free port of 127.0.0.1, for the API and browser tests."""
from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from core.settings import Settings
from pipelines.services import build_services

SG_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "stylegan"
SG_UNCOND = SG_DIR / "sg2_uncond_32.pkl"
SG_COND = SG_DIR / "sg2_cond4_64_fp16.pkl"


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1. It is released before the server binds it, so another
    process can take it in between: callers that serve on it must retry (as `running_studio` does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 5


@contextlib.contextmanager
def running_studio(tmp: Path, models=(SG_UNCOND, SG_COND), **settings_kw):
    """Yields the running Blocks (`.local_url`, `.atelier_runtime`); closes it afterwards.

    Gradio binds the port itself, so it cannot be handed a socket bound beforehand: when the port picked
    is taken before Gradio binds it ("Cannot find empty port"), a fresh one is picked, a few times."""
    from ui.studio import serve

    for attempt in range(PORT_ATTEMPTS):
        settings = Settings(host="127.0.0.1", port=free_port(), extra_models=tuple(str(m) for m in models),
                            models_dirs=(), output_dir=tmp / "outputs", cache_dir=tmp / "cache",
                            default_stylegan_model=str(models[0]), **settings_kw)
        try:
            demo = serve(build_services(settings), quiet=True)
            break
        except OSError as exc:
            if "Cannot find empty port" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                raise
    try:
        yield demo
    finally:
        demo.atelier_training.stop_all(wait=True, grace_s=10)   # a training run the test left going
        demo.close()


def tiny_sd_folder(tmp_path_factory) -> Path:
    """A tiny Stable Diffusion 1.x folder (random weights, 64 px), built once per test session."""
    import pytest

    pytest.importorskip("diffusers")
    from tests.diffusion_tiny import build_tiny_sd

    folder = tmp_path_factory.getbasetemp() / "ui-tiny-sd" / "tiny-sd"
    if not (folder / "model_index.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        build_tiny_sd(folder)
    return folder


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def require_chromium():
    """Skip the calling test module unless Debian's chromium and Playwright are here; returns playwright.sync_api."""
    import pytest

    if not CHROMIUM.exists():
        pytest.skip("browser tests need Debian's chromium at /usr/bin/chromium (`make test` installs it with apt)",
                    allow_module_level=True)
    return pytest.importorskip("playwright.sync_api")


@contextlib.contextmanager
def chromium():
    """A headless Chromium (Playwright), closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        try:
            yield b
        finally:
            b.close()
