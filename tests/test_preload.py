"""pipelines/preload.py: the studio imports diffusers in the background while it starts, and a diffusion
load waits for that import instead of racing it. Each case runs in a fresh interpreter (the import is
process-wide state)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_background_import_loads_the_pipeline_classes_and_the_loader_waits_for_it():
    got = _run(
        "import json, sys\n"
        "from pipelines import preload\n"
        "from pipelines.diffusion import _pipeline_class\n"   # the module itself imports diffusers on first use
        "before = 'diffusers' in sys.modules\n"
        "started = preload.start()\n"
        "again = preload.start()\n"
        "cls = _pipeline_class('sdxl')\n"          # waits for the background import, then uses it
        "st = preload.status()\n"
        "print(json.dumps({'before': before, 'started': started, 'again': again, 'cls': cls.__name__, **st,\n"
        "                  'sd_module': 'diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion' in sys.modules}))\n",
        ATELIER_PRELOAD="1")
    assert got["before"] is False, "pipelines.preload must not import diffusers by itself"
    assert got["started"] is True and got["again"] is False
    assert got["running"] is False and got["error"] is None and got["seconds"] > 0
    assert got["cls"] == "StableDiffusionXLPipeline" and got["sd_module"] is True


def test_preload_off_imports_nothing():
    got = _run(
        "import json, sys\n"
        "from pipelines import preload\n"
        "started = preload.start(); preload.wait()\n"
        "print(json.dumps({'started': started, 'imported': 'diffusers' in sys.modules, **preload.status()}))\n",
        ATELIER_PRELOAD="0")
    assert got == {"started": False, "imported": False, "seconds": None, "error": None, "running": False}


def test_the_studio_server_starts_the_background_import(tmp_path):
    """`serve` (what `python app.py` runs) starts the import once it is serving."""
    got = _run(
        "import json, sys\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, 'tests')\n"
        "from tests.ui_helpers import running_studio\n"
        "from pipelines import preload\n"
        f"with running_studio(Path({str(tmp_path)!r})) as demo:\n"
        "    st = preload.status(); preload.wait()\n"
        "print(json.dumps({'started': st['started'], 'imported': 'diffusers' in sys.modules,\n"
        "                  'error': preload.status()['error']}))\n",
        ATELIER_PRELOAD="1")
    assert got == {"started": True, "imported": True, "error": None}


LEAN_CODE = (
    "import json, sys, importlib.util\n"
    "from pipelines import preload\n"
    "from pipelines.diffusion import _pipeline_class\n"
    "{how}\n"
    "cls = _pipeline_class('sd')\n"
    "from transformers.utils import import_utils as tiu\n"
    "from diffusers.utils import import_utils as diu\n"
    "with preload.lean_imports():\n"                 # the stack is imported: a later use patches nothing
    "    inside = [bool(tiu.is_torchao_available()), bool(diu.is_torchao_available())]\n"
    "print(json.dumps({{'torchao': 'torchao' in sys.modules, 'sklearn': 'sklearn' in sys.modules, 'inside': inside,\n"
    "                  'installed': importlib.util.find_spec('torchao') is not None,\n"
    "                  'transformers_says': bool(tiu.is_torchao_available()), 'diffusers_says': bool(diu.is_torchao_available()),\n"
    "                  'cls': cls.__name__}}))\n")


@pytest.mark.parametrize("how", ["preload.start(); preload.wait()", "pass"], ids=["background", "loader"])
def test_the_stack_imports_without_the_optional_packages_the_studio_does_not_use(how):
    """transformers and diffusers import torchao (and transformers scikit-learn) when installed, for features the
    studio never uses through them; both import paths leave them out, and afterwards the libraries' checks tell
    the truth again (the FP8 toggle imports torchao itself)."""
    got = _run(LEAN_CODE.format(how=how), ATELIER_PRELOAD="1")
    if not got["installed"]:
        pytest.skip("torchao is not installed here: nothing to leave out")
    assert got["cls"] == "StableDiffusionPipeline"
    assert got["torchao"] is False and got["sklearn"] is False
    assert got["transformers_says"] is True and got["diffusers_says"] is True
    assert got["inside"] == [True, True]


def test_lean_imports_off_imports_them_as_the_libraries_do():
    got = _run(LEAN_CODE.format(how="pass"), ATELIER_LEAN_IMPORTS="0")
    if not got["installed"]:
        pytest.skip("torchao is not installed here")
    assert got["torchao"] is True and got["cls"] == "StableDiffusionPipeline"
