"""Crafted network pickles: refused with a clear error, and nothing they ask for ever happens.

Every attack writes a marker file or imports a canary module if it gets its way, so the
tests can check for side effects and not only for the exception.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import ModelLoadError, UnsafeModelError
from models.nvlabs_pickle import load_pickle_bytes, read_network_pickle
from models.stylegan import convert_pickle, load_generator, load_snapshot

CANARY = "atelier_canary_module"


def call_pickle(module: str, name: str, *args) -> bytes:
    """Protocol-2 pickle of `module.name(*args)` (GLOBAL + REDUCE), written opcode by opcode.

    The arguments are pickled on their own (plain data only), so crafting the file never
    imports or calls what it names.
    """
    body = pickle.dumps(tuple(args), protocol=2)[2:-1]   # strip PROTO header and STOP
    return b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n" + body + b"R."


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A path an attack would create; its location travels in an env var so payloads stay short."""
    path = tmp_path / "pwned"
    monkeypatch.setenv("ATELIER_PWNED", str(path))
    return path


@pytest.fixture
def canary(tmp_path, monkeypatch, marker):
    """A module on sys.path that writes the marker when imported."""
    src = tmp_path / "canary_src"
    src.mkdir()
    (src / f"{CANARY}.py").write_text(
        "import os\nopen(os.environ['ATELIER_PWNED'], 'w').write('imported')\n"
        "def boom(*a):\n    open(os.environ['ATELIER_PWNED'], 'w').write('called')\n")
    monkeypatch.syspath_prepend(str(src))
    assert CANARY not in sys.modules
    return CANARY


WRITE_MARKER = "open(__import__('os').environ['ATELIER_PWNED'], 'w').write('x')"


def attack_cases():
    return {
        "os.system": call_pickle("os", "system", 'touch "$ATELIER_PWNED"'),
        "posix.system": call_pickle("posix", "system", 'touch "$ATELIER_PWNED"'),
        "subprocess.Popen": call_pickle("subprocess", "Popen", ["sh", "-c", 'touch "$ATELIER_PWNED"']),
        "builtins.exec": call_pickle("builtins", "exec", WRITE_MARKER),
        "builtins.eval": call_pickle("builtins", "eval", WRITE_MARKER),
        "__builtin__.eval": call_pickle("__builtin__", "eval", WRITE_MARKER),
        "builtins.getattr": call_pickle("builtins", "getattr", "x", "y"),
        "importlib.import_module": call_pickle("importlib", "import_module", CANARY),
        "canary.boom": call_pickle(CANARY, "boom"),
        "torch.load": call_pickle("torch", "load", "/dev/null"),
        "persistence.persistent_class": call_pickle("torch_utils.persistence", "persistent_class", "x"),
        "dnnlib.util.call_func_by_name": call_pickle("dnnlib.util", "call_func_by_name", "os.system", "true"),
    }


@pytest.mark.parametrize("name", list(attack_cases()))
def test_forbidden_globals_are_refused_without_side_effects(name, tmp_path, marker, canary):
    data = attack_cases()[name]
    path = tmp_path / "evil.pkl"
    path.write_bytes(data)
    before = set(sys.modules)
    with pytest.raises(UnsafeModelError, match=r"refusing to load: the pickle asks for '[\w.]+'"):
        load_pickle_bytes(data)
    with pytest.raises(UnsafeModelError, match="not on the allow-list"):
        load_generator(path)          # passes through the loader unchanged
    with pytest.raises(UnsafeModelError):
        convert_pickle(path, tmp_path / "out")
    with pytest.raises(UnsafeModelError):
        load_snapshot(path)
    assert not marker.exists()
    assert canary not in sys.modules
    assert set(sys.modules) - before == set(), "refusing a pickle must not import anything"
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out").exists()


def test_refusal_message_names_the_global(tmp_path, marker):
    with pytest.raises(UnsafeModelError) as info:
        load_pickle_bytes(call_pickle("os", "system", "true"))
    assert "'os.system'" in str(info.value) and "safetensors" in str(info.value)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_reduce_to_exec_at_any_protocol(protocol, marker):
    class Exploit:
        def __reduce__(self):
            return (exec, (WRITE_MARKER,))

    data = pickle.dumps({"G_ema": Exploit()}, protocol=protocol)   # STACK_GLOBAL from protocol 4
    with pytest.raises(UnsafeModelError, match=r"(__builtin__|builtins)\.exec"):
        load_pickle_bytes(data)
    assert not marker.exists()
    pickle.loads(data)                                             # proof the payload is live
    assert marker.exists()


def test_canary_payload_is_live(canary, marker):
    # Sanity check of the fixture: importing the canary *would* leave a trace.
    __import__(canary)
    assert marker.read_text() == "imported"
    del sys.modules[canary]


def test_booby_trapped_module_source_is_never_executed(testdata, tmp_path, marker):
    """A real NVlabs pickle whose embedded source would write a file when exec'd.

    NVlabs' own loader execs that source while unpickling; ours must load the weights
    (the network is still a genuine StyleGAN2) and leave the source unrun.
    """
    data = (testdata / "stylegan" / "sg2_uncond_32.pkl").read_bytes()
    line = b"# Copyright (c) 2021, NVIDIA CORPORATION & AFFILIATES.  All rights reserved."
    assert data.count(line) == 1
    payload = WRITE_MARKER.encode() + b"  #"
    assert len(payload) <= len(line)
    payload = payload.ljust(len(line), b"#")          # same length keeps the pickle's string sizes valid
    evil = tmp_path / "trapped.pkl"
    evil.write_bytes(data.replace(line, payload))

    networks = read_network_pickle(evil)
    assert networks["G_ema"].module_src.startswith(WRITE_MARKER)   # the trap is really in there
    loaded = load_generator(evil)
    ref = np.load(testdata / "stylegan" / "sg2_uncond_32_ref.npz")["seed0_psi1.0"]
    z = torch.from_numpy(np.random.RandomState(0).randn(1, 64).astype(np.float32))
    with torch.no_grad():
        out = loaded.G(z, None, noise_mode="const")[0].numpy()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-4
    convert_pickle(evil, tmp_path / "converted")
    load_snapshot(evil)
    assert not marker.exists()
    exec(networks["G_ema"].module_src.splitlines()[0])   # what NVlabs' loader would have done
    assert marker.exists()


def fake_persistent(meta: dict) -> bytes:
    return call_pickle("torch_utils.persistence", "_reconstruct_persistent_obj", meta)


def test_fake_persistent_object_source_is_not_run(tmp_path, marker):
    meta = {"type": "class", "version": 6, "module_src": WRITE_MARKER, "class_name": "training.networks.Generator",
            "state": {"_modules": {}, "_parameters": {}, "_buffers": {}, "z_dim": 8}}
    path = tmp_path / "fake.pkl"
    path.write_bytes(fake_persistent(meta))
    rec = read_network_pickle(path)["G_ema"]
    assert rec.module_src == WRITE_MARKER
    with pytest.raises(ModelLoadError, match="Generator|synthesis"):
        load_generator(path)
    assert not marker.exists()


@pytest.mark.parametrize("meta,message", [
    ({"type": "module", "module_src": WRITE_MARKER, "state": {}}, "unknown kind"),
    ({"type": "class", "module_src": WRITE_MARKER, "class_name": "Generator", "state": "exec me"},
     "without a state"),
    ({"type": "class", "module_src": WRITE_MARKER, "class_name": "Generator",
      "state": {"_modules": {"synthesis": "not a record"}}}, "not a recorded network object"),
])
def test_malformed_persistent_objects_are_refused(tmp_path, marker, meta, message):
    path = tmp_path / "fake.pkl"
    path.write_bytes(fake_persistent(meta))
    with pytest.raises(UnsafeModelError, match=message):
        load_generator(path)
    assert not marker.exists()


def test_malicious_tensor_storage_is_refused(tmp_path, marker):
    """A storage blob is itself a torch.save archive; its inner pickle goes through weights_only."""
    class Exploit:
        def __reduce__(self):
            return (exec, (WRITE_MARKER,))

    buf = io.BytesIO()
    torch.save({"x": Exploit()}, buf)
    data = b"\x80\x03ctorch.storage\n_load_from_bytes\n" + pickle.dumps((buf.getvalue(),), protocol=3)[2:-1] + b"R."
    path = tmp_path / "storage.pkl"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError):
        load_generator(path)
    assert not marker.exists()


def test_malicious_tensor_storage_is_reported_as_unsafe(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (exec, ("pass",))

    buf = io.BytesIO()
    torch.save({"x": Exploit()}, buf)
    data = b"\x80\x03ctorch.storage\n_load_from_bytes\n" + pickle.dumps((buf.getvalue(),), protocol=3)[2:-1] + b"R."
    with pytest.raises(UnsafeModelError) as info:
        load_pickle_bytes(data)
    assert "weights_only=False" not in str(info.value)


@pytest.mark.parametrize("content", [b"", b"not a pickle at all", b"\x80\x04\x95", b"\x80\x02}q\x00(X"])
def test_garbage_is_a_load_error(tmp_path, content):
    path = tmp_path / "garbage.pkl"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as info:
        load_generator(path)
    assert type(info.value) is ModelLoadError
    assert "could not parse the network pickle" in str(info.value)


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.999])
def test_truncated_real_pickle_is_a_load_error(testdata, tmp_path, fraction):
    data = (testdata / "stylegan" / "sg2_uncond_32.pkl").read_bytes()
    path = tmp_path / "truncated.pkl"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError) as info:
        load_generator(path)
    assert type(info.value) is ModelLoadError


def test_torch_save_archive_named_pkl_is_pointed_to_pt(tmp_path):
    path = tmp_path / "weights.pkl"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(ModelLoadError, match=r"\.pt checkpoint"):
        load_generator(path)


def test_marker_fixture_is_isolated(marker):
    assert not marker.exists() and Path(os.environ["ATELIER_PWNED"]) == marker
