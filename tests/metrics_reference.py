"""The implementations people publish FID, KID, IS and LPIPS with, loaded for comparison in CPU tests.

torch-fidelity, pytorch-fid, clean-fid and lpips each declare torchvision as a dependency; Atelier never
installs it, so requirements-reference.txt installs them with --no-deps. What the tests call from them
runs without torchvision, but their modules import it at the top. So they are imported under a stand-in
`torchvision` that exists only while they import (and is removed from sys.modules afterwards, so no other
code sees it):

- any `torchvision.*` module resolves to an empty package whose capitalised attributes are classes (so
  `class FIDInceptionA(torchvision.models.inception.InceptionA)` still defines) that raise if built;
- `torchvision.models.alexnet` / `vgg16` build torchvision's layer layout (`.features` with the same
  indices), because lpips takes its trunk from them. The layouts are written out below from torchvision's
  model definitions (alexnet.py; vgg.py, configuration "D"), independently of evaluation/lpips.py.

Everything else compared is the packages' own code: torch-fidelity's FeatureExtractorInceptionV3 (its
TF-compatible resize and the FID network), its FID/KID/IS functions, pytorch-fid's and clean-fid's Fréchet
distance, clean-fid's resize and KID, torchmetrics' FID/KID, lpips' LPIPS module, and the input-path code
of pytorch-fid's InceptionV3.forward, clean-fid's InceptionV3W.forward and torchmetrics' NoTrainInceptionV3
(called with a stand-in for their network that records what it receives).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from functools import lru_cache

import pytest
import torch.nn as nn

PACKAGES = ("torch_fidelity", "pytorch_fid", "cleanfid", "lpips", "torchmetrics")


class _NeedsTorchvision(nn.Module):
    """Stands for any torchvision class: subclassing works, building one does not."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not installed; this reference code path needs it")


def _alexnet_features() -> nn.Sequential:
    # torchvision.models.AlexNet.features
    return nn.Sequential(
        nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
    )


def _vgg16_features() -> nn.Sequential:
    # torchvision.models.vgg.make_layers(cfgs["D"], batch_norm=False)
    layers: list[nn.Module] = []
    channels = 3
    for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(channels, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            channels = v
    return nn.Sequential(*layers)


def _trunk(features):
    def build(*args, pretrained=False, weights=None, **kwargs):
        if pretrained or weights is not None:
            raise RuntimeError("the reference trunk is built without weights; the tests load them from a file")
        return types.SimpleNamespace(features=features())
    return build


class _StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []                      # a package: submodules import through the finder below
        self.__version__ = "0.0.0+stub"

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():
            return _NeedsTorchvision
        child = sys.modules.get(f"{self.__name__}.{attr}") or _StubModule(f"{self.__name__}.{attr}")
        sys.modules[child.__name__] = child
        setattr(self, attr, child)
        return child


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return sys.modules.get(spec.name) or _StubModule(spec.name)

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def torchvision_stand_in():
    """A stand-in torchvision for the duration of some imports (a real one, if installed, is used as is)."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    finder = _StubFinder()
    root = _StubModule("torchvision")
    sys.modules["torchvision"] = root
    root.models.alexnet = _trunk(_alexnet_features)
    root.models.vgg16 = _trunk(_vgg16_features)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


@lru_cache(maxsize=1)
def references() -> types.SimpleNamespace:
    """The reference functions and classes, imported once per test session."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        pytest.fail(f"reference implementations not installed: {', '.join(missing)}. "
                    f"Run: pip install --no-deps -r requirements-reference.txt (make setup does)", pytrace=False)
    with torchvision_stand_in():
        from cleanfid import fid as cleanfid_fid
        from cleanfid import resize as cleanfid_resize
        from cleanfid.inception_torchscript import InceptionV3W
        import lpips
        from pytorch_fid.fid_score import calculate_frechet_distance
        from pytorch_fid.inception import InceptionV3
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x
        from torch_fidelity.metric_fid import fid_statistics_to_metric
        from torch_fidelity.metric_isc import isc_features_to_metric
        from torch_fidelity.metric_kid import kid_features_to_metric
    return types.SimpleNamespace(
        FeatureExtractorInceptionV3=FeatureExtractorInceptionV3, fidelity_tf_resize=interpolate_bilinear_2d_like_tensorflow1x,
        PytorchFidInceptionV3=InceptionV3, CleanFidInceptionV3W=InceptionV3W,
        fidelity_fid=fid_statistics_to_metric, fidelity_kid=kid_features_to_metric, fidelity_isc=isc_features_to_metric,
        pytorch_fid_frechet_distance=calculate_frechet_distance,
        cleanfid_frechet_distance=cleanfid_fid.frechet_distance, cleanfid_kernel_distance=cleanfid_fid.kernel_distance,
        cleanfid_make_resizer=cleanfid_resize.make_resizer,
        LPIPS=lpips.LPIPS,
    )


class _Identity(nn.Module):
    """A torchmetrics 'feature extractor' that passes precomputed features through unchanged."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, x):
        return x


@lru_cache(maxsize=1)
def torchmetrics_references() -> types.SimpleNamespace:
    """torchmetrics' FID and KID (a slow import: it pulls in transformers). torchmetrics asks find_spec
    whether torchvision exists, so it is imported without the stand-in, reusing torch_fidelity from above."""
    references()
    from torchmetrics.image.fid import FrechetInceptionDistance, NoTrainInceptionV3
    from torchmetrics.image.kid import KernelInceptionDistance

    return types.SimpleNamespace(FID=FrechetInceptionDistance, KID=KernelInceptionDistance, identity=_Identity,
                                 NoTrainInceptionV3=NoTrainInceptionV3)
