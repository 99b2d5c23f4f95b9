"""The error for a hub model that cannot be downloaded is whole and says what to do.

The hub is made unreachable for sure, not by luck of the network: HF_ENDPOINT points at a port of 127.0.0.1
that this test holds bound but not listening (connection refused at once). huggingface_hub reads HF_ENDPOINT
at import, so each check runs in a fresh Python with a fresh, empty HF_HOME."""
from __future__ import annotations

import html
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.diffusion import _shorten

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "stable-diffusion-v1-5/stable-diffusion-v1-5"      # the studio's default diffusion model (first hub entry)

STUDIO_SCRIPT = r"""
import json, sys
from pathlib import Path
from gradio_client import Client
from tests.ui_helpers import SG_UNCOND, running_studio

tmp = Path(sys.argv[1])
with running_studio(tmp, models=(SG_UNCOND,)) as demo:
    c = Client(demo.local_url, verbose=False)
    try:
        c.predict(backend="diffusion", model=sys.argv[2], prompt="a red fox", seed="1", steps=2, api_name="/generate")
        out = {"error": None}
    except Exception as exc:       # gradio_client's AppError carries the gr.Error text
        out = {"error": str(exc)}
    out["telemetry_progress"] = c.predict(api_name="/telemetry")[5]
print("RESULT " + json.dumps(out))
"""

LOADER_SCRIPT = r"""
import json, sys
from pipelines.diffusion import load_diffusion
try:
    load_diffusion(sys.argv[2], hf_cache_dir=sys.argv[1])
    print("RESULT " + json.dumps({"error": None}))
except Exception as exc:
    print("RESULT " + json.dumps({"error": str(exc), "type": type(exc).__name__}))
"""


@pytest.fixture
def unreachable_hub_env(tmp_path):
    with socket.socket() as s:           # bound, never listening: every connection is refused
        s.bind(("127.0.0.1", 0))
        env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{s.getsockname()[1]}", HF_HOME=str(tmp_path / "hf"),
                   HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
        env.pop("HF_HUB_CACHE", None)
        env.pop("HUGGINGFACE_HUB_CACHE", None)
        yield env


def _run(script: str, env: dict, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=500)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"no result (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):])


def _assert_whole_with_what_to_do(msg: str) -> None:
    assert DEFAULT in msg and "cannot be reached" in msg, msg
    assert f"huggingface-cli download {DEFAULT}" in msg and "Add a model" in msg and "5.5 GB" in msg, msg
    assert msg.rstrip().endswith(".") and "…" not in msg, msg      # not cut off mid-sentence


def test_the_loader_says_the_hub_cannot_be_reached_whole_and_what_to_do(unreachable_hub_env, tmp_path):
    pytest.importorskip("diffusers")
    out = _run(LOADER_SCRIPT, unreachable_hub_env, tmp_path / "empty-cache", DEFAULT)
    assert out.get("type") == "ModelLoadError", out
    _assert_whole_with_what_to_do(out["error"])


def test_the_studio_shows_the_default_models_hub_error_whole(unreachable_hub_env, tmp_path, testdata):
    pytest.importorskip("diffusers")
    pytest.importorskip("gradio_client")
    out = _run(STUDIO_SCRIPT, unreachable_hub_env, tmp_path / "studio", DEFAULT)
    assert out["error"], out
    _assert_whole_with_what_to_do(out["error"])                    # the toast
    line = html.unescape(re.sub(r"<[^>]+>", "", out["telemetry_progress"]))
    _assert_whole_with_what_to_do(line)                            # and the progress line under Generate
    assert str(tmp_path / "hf") in line                            # names the cache it looked in


def test_a_long_error_line_is_shortened_at_a_sentence_or_word_never_mid_word():
    long = "Cannot find a snapshot folder on the local disk. " * 4 + "To enable look-ups pass local_files_only=False"
    short = _shorten(long, 120)
    assert len(short) <= 122 and short.endswith(". …") and long.startswith(short[:-2])
    words = "a-very-long-word " * 30
    cut = _shorten(words, 100)
    assert cut.endswith(" …") and cut[:-2].split(" ")[-1] == "a-very-long-word"
    assert _shorten("short enough", 100) == "short enough"
