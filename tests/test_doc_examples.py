"""Every documented `gradio_client` example runs, against a running studio: the ```python blocks of README.md
and docs/*.md that use gradio_client are executed as written, in a fresh Python, with only these substitutions
(the tiny test models stand in for the documented ones, which would be gigabytes or hours):

| documented                                    | in the test                                              |
| --------------------------------------------- | -------------------------------------------------------- |
| `http://127.0.0.1:7860/`                      | the studio's URL (a free port of 127.0.0.1)               |
| `model="stabilityai/sd-turbo"`, `"512x512"`    | the tiny SD folder (tests/diffusion_tiny.py), `"64x64"`   |
| `data="/data/my_images"`, `preset="stylegan2"`, `resolution=256`, `kimg=5000` | a 16 px .npy data set, `"tiny"`, 16, 50, and `log_every=1` |
| `image.png` (a relative path)                 | an A1111 PNG from the test data, in the working folder    |

Each documented string must still be in the docs (else the test fails: the table and the docs drifted apart).
The StyleGAN examples use the studio's default model, the NVlabs test pickle."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gradio_client")

from tests.ui_helpers import running_studio, tiny_sd_folder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def documented_examples() -> list[tuple[str, int, str]]:
    """(file, line, code) of each python block that uses gradio_client."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            if "gradio_client" in m.group(1):
                out.append((str(doc.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def substitutions(url: str, tiny_sd: Path, data: Path) -> list[tuple[str, str]]:
    return [
        ('"http://127.0.0.1:7860/"', repr(url)),
        ('model="stabilityai/sd-turbo"', f"model={str(tiny_sd)!r}"),
        ('size="512x512"', 'size="64x64"'),
        ('data="/data/my_images", preset="stylegan2", resolution=256, kimg=5000,',
         f'data={str(data)!r}, preset="tiny", resolution=16, kimg=50, log_every=1,'),
    ]


def test_the_docs_have_gradio_client_examples():
    found = documented_examples()
    assert any(f == "docs/ui.md" for f, _, _ in found), found
    assert all("Client(" in code for _, _, code in found)


@pytest.fixture(scope="module")
def studio(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("studio-docs"), queue_max_size=8) as demo:
        yield demo


@pytest.mark.parametrize("where,line,code", documented_examples(), ids=lambda v: str(v) if isinstance(v, int) else None)
def test_a_documented_example_runs(where, line, code, studio, tmp_path, tmp_path_factory, testdata, monkeypatch):
    from tests.test_training_runs import write_tiny_dataset

    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # the trainer child inherits it (2-core box)
    subs = substitutions(studio.local_url, tiny_sd_folder(tmp_path_factory), write_tiny_dataset(tmp_path / "data"))
    for doc, ours in subs:
        if doc in code:
            code = code.replace(doc, ours)
    assert "7860" not in code, f"{where}:{line}: an example talks to a studio the test did not start"
    shutil.copy(testdata / "pnginfo" / "a1111_v1_6.png", tmp_path / "image.png")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=550)
    assert r.returncode == 0, f"the example at {where}:{line} failed:\n{r.stderr[-4000:]}"


def test_every_substitution_still_matches_the_docs(tmp_path):
    text = "\n".join(code for _, _, code in documented_examples())
    for doc, _ours in substitutions("u", tmp_path, tmp_path):
        assert doc in text, f"the docs no longer contain {doc!r}: update the table in this test's docstring"
