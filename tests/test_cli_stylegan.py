"""The CLI contract of `python app.py generate --backend stylegan`, run as a user would."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=ROOT):
    p = subprocess.run([sys.executable, "app.py", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_npy_matches_nvlabs_reference(testdata, tmp_path):
    pkl = testdata / "stylegan" / "sg2_uncond_32.pkl"
    ref = np.load(testdata / "stylegan" / "sg2_uncond_32_ref.npz")
    key = next(k for k in ref.files if k.endswith("psi1.0") or k.endswith("psi1")) if any(
        k.endswith(("psi1.0", "psi1")) for k in ref.files) else ref.files[0]
    seed = int(key.split("_")[0][4:])
    psi = float(key.split("_psi")[1])
    out = tmp_path / "raw.npy"
    rc, so, se = run_cli("generate", "--backend", "stylegan", "--model", pkl, "--seed", seed, "--truncation", psi,
                         "--out", out, "--quiet")
    assert rc == 0, se
    summary = last_json(so)
    assert summary["outputs"] == [str(out)] and summary["device"] == "cpu" and summary["dtype"] == "fp32"
    assert {"synthesis", "load"} <= set(summary["latency_ms"]) and summary["peak_memory_bytes"] > 0
    assert "precision" in summary["optimizations"]
    raw = np.load(out)
    assert raw.dtype == np.float32 and raw.shape == (1,) + ref[key].shape
    rel = np.linalg.norm(raw[0] - ref[key]) / np.linalg.norm(ref[key])
    assert rel < 1e-4


def test_png_grid_carries_parameters_and_reproduces(testdata, tmp_path):
    pkl = testdata / "stylegan" / "sg2_cond4_64_fp16.pkl"
    png = tmp_path / "grid.png"
    rc, so, se = run_cli("generate", "--model", pkl, "--seeds", "0-3", "--class-index", 2, "--truncation", 0.7,
                         "--out", png, "--quiet")
    assert rc == 0, se
    im = Image.open(png)
    assert im.size == (128, 128)   # 2x2 grid of 64px images
    meta = json.loads(im.text["atelier"])
    assert meta["seeds"] == [0, 1, 2, 3] and meta["class_index"] == 2 and meta["truncation_psi"] == 0.7
    assert meta["truncation_centre"] == "class"     # a conditional pickle: the class's own mean w by default
    again = tmp_path / "again.png"
    rc, so, se = run_cli("generate", "--from-png", png, "--out", again, "--quiet")
    assert rc == 0, se
    assert np.array_equal(np.asarray(Image.open(again)), np.asarray(im))


@pytest.mark.parametrize("args,needle", [
    (["--model", "/no/such/file.pkl"], "not found"),
    (["--seed", "4294967296"], "seed must be an integer"),
    (["--truncation", "nan"], "finite"),
    (["--truncation-centre", "middle"], "truncation centre must be 'class'"),
    (["--class-index", "7"], "out of range"),
    (["--out", "x.jpg"], "must end in .png or .npy"),
])
def test_bad_input_is_one_clear_line(testdata, tmp_path, args, needle):
    pkl = testdata / "stylegan" / "sg2_cond4_64_fp16.pkl"
    base = ["generate", "--model", pkl, "--class-index", "1", "--out", tmp_path / "o.png", "--quiet"]
    # later options override earlier ones in argparse
    rc, so, se = run_cli(*base, *args)
    assert rc != 0
    lines = [l for l in se.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], se
    assert "Traceback" not in se


def test_unconditional_model_refuses_class(testdata, tmp_path):
    rc, so, se = run_cli("generate", "--model", testdata / "stylegan" / "sg2_uncond_32.pkl", "--class-index", 0,
                         "--out", tmp_path / "o.png", "--quiet")
    assert rc == 2 and "unconditional" in se


def test_crafted_pickle_refused_without_side_effect(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (eval, (f"open({str(marker)!r}, 'w').write('x')",))

    bad = tmp_path / "evil.pkl"
    bad.write_bytes(pickle.dumps({"G_ema": Evil()}))
    rc, so, se = run_cli("generate", "--model", bad, "--out", tmp_path / "o.png", "--quiet")
    assert rc == 2 and "refusing" in se and not marker.exists()


def test_compare_reports_the_reference_and_the_toggles(testdata, tmp_path):
    from core.pnginfo import read_png_params

    model = testdata / "stylegan" / "sg2_uncond_32.pkl"
    out = tmp_path / "cmp.png"
    rc, stdout, stderr = run_cli("generate", "--backend", "stylegan", "--model", model, "--seeds", "0-2",
                                 "--truncation", "0.7", "--precision", "bf16", "--fp8", "--compare", "--out", out,
                                 "--quiet")
    assert rc == 0, stderr
    summary = last_json(stdout)
    c = summary["compare"]
    assert summary["outputs"] == [str(out), str(tmp_path / "cmp-reference.png"), str(tmp_path / "cmp-difference.png")]
    assert c["n_images"] == 3 and c["reference"]["flags"]["precision"] == "fp32"
    assert c["candidate"]["optimizations"]["precision"]["mode"] == "autocast-bf16"
    assert c["candidate"]["optimizations"]["fp8"]["applied"] is False            # skipped on the CPU, with its reason
    assert 30 < c["drift"]["psnr_db"] < 80 and c["reference"]["latency_ms"] > 0 and c["speedup"] > 0
    assert Image.open(tmp_path / "cmp-difference.png").size == (32, 32)
    assert read_png_params(out)["flags"]["precision"] == "bf16"
    # every toggle off: nothing to compare, one clear line
    rc, _, stderr = run_cli("generate", "--backend", "stylegan", "--model", model, "--seed", "1", "--compare",
                            "--out", tmp_path / "x.png", "--quiet")
    assert rc != 0 and "Nothing to compare" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("value,needle", [("0", "must be at least 1; got 0"), ("-3", "must be at least 1; got -3"),
                                          ("two", "must be a whole number of at least 1")])
def test_batch_size_below_one_is_an_error_not_the_default(tmp_path, value, needle):
    # argparse refuses it before any model is opened (it used to become the default of 8 silently)
    rc, so, se = run_cli("generate", "--model", tmp_path / "unused.pkl", "--batch-size", value,
                         "--out", tmp_path / "o.png", "--quiet")
    assert rc == 2 and f"argument --batch-size: {needle}" in se, se
    assert "Traceback" not in se and not (tmp_path / "o.png").exists()
