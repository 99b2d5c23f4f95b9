"""A model file that declares a huge network around tiny weights is refused before anything is built.

Issue 13: a 777-byte NVlabs-style pickle using only allowed names, but declaring e.g.
img_resolution=2**20, made `Generator(**init_kwargs)` allocate gigabytes before any weight was
compared. Now the kwargs are bounds-checked, the network is built on the meta device and compared
with the file's tensors, and only a file that fits is built for real (models/arch_limits.py).
"""
from __future__ import annotations

import gc
import json
import pickle
import sys
import types

import psutil
import pytest
import torch
from safetensors.torch import save_file

from core.errors import ModelLoadError
from models import arch_limits, stylegan2, stylegan3
from models.stylegan import FORMAT, build_generator, load_generator

MiB = 1 << 20
HUGE_IN_BOUNDS = dict(img_resolution=2048, channel_base=1 << 22, channel_max=8192)   # ~10 GB if built


# ---------------------------------------------------------------------------------------------
# Crafting NVlabs-style pickles without NVlabs' code: a stand-in torch_utils.persistence module, so
# the pickle names exactly the global a real one names (and nothing else).

class _Persistent:
    def __init__(self, class_name: str, init_kwargs: dict | None = None, params: dict | None = None,
                 buffers: dict | None = None, children: dict | None = None):
        self.meta = {"type": "class", "version": 6, "module_src": "", "class_name": class_name,
                     "state": {"_init_args": (), "_init_kwargs": dict(init_kwargs or {}),
                               "_parameters": dict(params or {}), "_buffers": dict(buffers or {}),
                               "_modules": dict(children or {}), "training": False}}

    def __reduce__(self):
        return (sys.modules["torch_utils.persistence"]._reconstruct_persistent_obj, (self.meta,))


@pytest.fixture
def persistence(monkeypatch):
    pkg = types.ModuleType("torch_utils")
    mod = types.ModuleType("torch_utils.persistence")

    def _reconstruct_persistent_obj(meta):   # never called here: only its name goes into the pickle
        raise AssertionError("stand-in called")

    _reconstruct_persistent_obj.__module__ = "torch_utils.persistence"
    _reconstruct_persistent_obj.__qualname__ = "_reconstruct_persistent_obj"
    mod._reconstruct_persistent_obj = _reconstruct_persistent_obj
    pkg.persistence = mod
    monkeypatch.setitem(sys.modules, "torch_utils", pkg)
    monkeypatch.setitem(sys.modules, "torch_utils.persistence", mod)
    return mod


def sg2_pickle(path, **overrides) -> None:
    """A StyleGAN2 G_ema with tiny weights whose init_kwargs declare whatever `overrides` say."""
    kwargs = dict(z_dim=512, w_dim=512, c_dim=0, img_resolution=1024, img_channels=3,
                  mapping_kwargs={"num_layers": 8}, channel_base=32768, channel_max=512)
    kwargs.update(overrides)
    tiny = {"weight": torch.zeros(1)}
    block = _Persistent("SynthesisBlock", params=tiny)
    synthesis = _Persistent("SynthesisNetwork", children={"b4": block})
    mapping = _Persistent("MappingNetwork", params=tiny)
    G = _Persistent("Generator", init_kwargs=kwargs, children={"synthesis": synthesis, "mapping": mapping})
    path.write_bytes(pickle.dumps({"G_ema": G}, protocol=4))


def sg3_pickle(path, **overrides) -> None:
    kwargs = dict(z_dim=512, w_dim=512, c_dim=0, img_resolution=1024, img_channels=3,
                  mapping_kwargs={"num_layers": 2}, channel_base=32768, channel_max=512)
    kwargs.update(overrides)
    inp = _Persistent("SynthesisInput", buffers={"freqs": torch.zeros(4, 2)})
    synthesis = _Persistent("SynthesisNetwork", children={"input": inp})
    G = _Persistent("Generator", init_kwargs=kwargs, children={"synthesis": synthesis})
    path.write_bytes(pickle.dumps({"G_ema": G}, protocol=4))


def our_format(path, **overrides):
    """NAME.safetensors (tiny) + NAME.json declaring `overrides`."""
    kwargs = dict(z_dim=512, w_dim=512, c_dim=0, img_resolution=1024, img_channels=3,
                  mapping_kwargs={"num_layers": 8}, channel_base=32768, channel_max=512)
    kwargs.update(overrides)
    save_file({"mapping.fc0.weight": torch.zeros(2, 2)}, str(path.with_suffix(".safetensors")))
    path.with_suffix(".json").write_text(json.dumps({"format": FORMAT, "arch": "stylegan2", "init_kwargs": kwargs}))
    return path.with_suffix(".safetensors")


@pytest.fixture
def real_builds(monkeypatch):
    """Devices on which a synthesis network was constructed ('meta' for the shape probe)."""
    seen: list[str] = []
    for cls in (stylegan2.SynthesisNetwork, stylegan3.SynthesisNetwork):
        orig = cls.__init__

        def spy(self, *a, __orig=orig, **k):
            seen.append(torch.empty(0).device.type)
            __orig(self, *a, **k)

        monkeypatch.setattr(cls, "__init__", spy)
    return seen


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


# ---------------------------------------------------------------------------------------------
# Bounds: refused with the field named, before any construction (not even on meta)


def assert_refused_before_building(path, field: str, real_builds: list) -> None:
    """The load fails naming `field`, before even the meta-device probe builds anything."""
    with pytest.raises(ModelLoadError, match=f"'{field}'"):
        load_generator(path)
    assert real_builds == []


@pytest.mark.parametrize("overrides,field", [
    ({"img_resolution": 2**20}, "img_resolution"),
    ({"img_resolution": 1000}, "img_resolution"),
    ({"img_resolution": 2}, "img_resolution"),
    ({"channel_max": 10**6}, "channel_max"),
    ({"channel_base": 2**40}, "channel_base"),
    ({"z_dim": 10**5}, "z_dim"),
    ({"w_dim": 0}, "w_dim"),
    ({"c_dim": -1}, "c_dim"),
    ({"img_channels": 3.5}, "img_channels"),
    ({"mapping_kwargs": {"num_layers": 10**4}}, "mapping_kwargs.num_layers"),
    ({"layer_channels": {"b8.conv0": 10**7}}, "layer_channels.b8.conv0"),
    ({"conv_clamp": float("inf")}, "conv_clamp"),
    ({"resample_filter": [1] * 10**4}, "resample_filter"),
])
def test_pickle_declaring_an_absurd_network_is_refused_by_field(tmp_path, persistence, real_builds, overrides,
                                                                field):
    path = tmp_path / "evil.pkl"
    sg2_pickle(path, **overrides)
    assert_refused_before_building(path, field, real_builds)


@pytest.mark.parametrize("overrides,field", [
    ({"img_resolution": 2**20}, "img_resolution"),
    ({"channel_max": 10**6}, "channel_max"),
    ({"num_layers": 10**5}, "num_layers"),
    ({"num_layers": 4, "num_critical": 4}, "num_critical"),
    ({"margin_size": 10**6}, "margin_size"),
])
def test_stylegan3_pickle_declaring_an_absurd_network_is_refused(tmp_path, persistence, real_builds, overrides,
                                                                 field):
    path = tmp_path / "evil3.pkl"
    sg3_pickle(path, **overrides)
    assert_refused_before_building(path, field, real_builds)


def test_our_format_declaring_an_absurd_network_is_refused(tmp_path, real_builds):
    weights = our_format(tmp_path / "evil", img_resolution=2**20)
    with pytest.raises(ModelLoadError, match="'img_resolution'.*power of two between 4 and 2048"):
        load_generator(weights)
    assert real_builds == []


# ---------------------------------------------------------------------------------------------
# In bounds but not what the file holds: built on meta only, compared, refused


@pytest.mark.parametrize("make", [sg2_pickle, sg3_pickle], ids=["stylegan2", "stylegan3"])
def test_huge_in_bounds_declaration_is_only_built_on_meta(tmp_path, persistence, real_builds, make):
    path = tmp_path / "big.pkl"
    make(path, **HUGE_IN_BOUNDS)
    with pytest.raises(ModelLoadError, match="do not fit .*checked before building it"):
        load_generator(path)
    assert real_builds == ["meta"]


def test_our_format_huge_declaration_refused_before_the_weights_are_read(tmp_path, real_builds, monkeypatch):
    import safetensors.torch

    weights = our_format(tmp_path / "big", **HUGE_IN_BOUNDS)

    def no_read(*a, **k):
        raise AssertionError("weights read before the config was checked against the header")

    monkeypatch.setattr(safetensors.torch, "load_file", no_read)
    with pytest.raises(ModelLoadError, match="do not fit .*checked before building it"):
        load_generator(weights)
    assert real_builds == ["meta"]


@pytest.mark.parametrize("kind", ["pickle", "pickle-in-bounds", "ours-in-bounds"])
def test_refused_loads_leave_memory_where_it_was(tmp_path, persistence, kind):
    if kind == "pickle":
        path = tmp_path / "evil.pkl"
        sg2_pickle(path, img_resolution=2**20)
    elif kind == "pickle-in-bounds":
        path = tmp_path / "big.pkl"
        sg2_pickle(path, **HUGE_IN_BOUNDS)
    else:
        path = our_format(tmp_path / "big", **HUGE_IN_BOUNDS)
    errors = []
    with pytest.raises(ModelLoadError):   # warm-up: imports and allocator pools settle
        load_generator(path)
    before = rss()
    for _ in range(5):
        try:
            load_generator(path)
        except ModelLoadError as exc:
            errors.append(exc)         # kept, as a server's last-error display would keep it
    after = rss()
    assert len(errors) == 5
    assert after - before < 100 * MiB, f"RSS grew by {(after - before) / MiB:.0f} MiB over 5 refused loads"


def test_a_refused_exception_holds_no_module(tmp_path, persistence):
    """Nothing reachable from the error (its frames, its context) is a torch module."""
    path = tmp_path / "big.pkl"
    sg2_pickle(path, **HUGE_IN_BOUNDS)
    with pytest.raises(ModelLoadError) as info:
        load_generator(path)
    exc = info.value
    assert exc.__context__ is None and exc.__cause__ is None
    tb = exc.__traceback__
    while tb is not None:
        assert not any(isinstance(v, torch.nn.Module) for v in tb.tb_frame.f_locals.values()), tb.tb_frame
        tb = tb.tb_next


# ---------------------------------------------------------------------------------------------
# The checks themselves


def test_check_init_kwargs_accepts_nvlabs_configs():
    for kw in [dict(z_dim=512, w_dim=512, c_dim=0, img_resolution=1024, img_channels=3, channel_base=32768,
                    channel_max=512, num_fp16_res=4, conv_clamp=256, mapping_kwargs={"num_layers": 8}),
               dict(z_dim=512, w_dim=512, c_dim=1000, img_resolution=256, img_channels=3, channel_base=65536,
                    channel_max=1024, magnitude_ema_beta=0.999, conv_kernel=1, use_radial_filters=True,
                    mapping_kwargs={"num_layers": 2}, num_layers=14, num_critical=2)]:
        assert arch_limits.check_init_kwargs(kw) == kw


def test_build_generator_checks_bounds_and_shapes():
    small = dict(z_dim=8, w_dim=8, c_dim=0, img_resolution=8, img_channels=3, channel_base=64, channel_max=16,
                 mapping_kwargs={"num_layers": 2})
    G = build_generator("stylegan2", small)
    shapes = {k: tuple(v.shape) for k, v in G.state_dict().items()}
    assert not any(t.is_meta for t in build_generator("stylegan2", small, shapes=shapes).state_dict().values())
    with pytest.raises(ModelLoadError, match="'img_resolution'"):
        build_generator("stylegan2", {**small, "img_resolution": 3})
    with pytest.raises(ModelLoadError, match="wrong shape"):
        build_generator("stylegan2", {**small, "channel_max": 8}, shapes=shapes)
