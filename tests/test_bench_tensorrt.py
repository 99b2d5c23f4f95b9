"""The TensorRT path as far as a machine without TensorRT can check it (the bench's `tensorrt` row): the
engine cache key and the builder's precision plan for TensorRT 10 (weakly typed + FP16/BF16 flags) and 11
(no such flags: strongly typed)."""
import torch

from optim import tensorrt as ot


def test_engine_key_tells_architectures_apart_even_when_the_weights_hash_is_only_a_name():
    # The bench's random weights are named by their seed ("random000…0"), the same for every architecture:
    # the structure fingerprint keeps two networks from sharing an engine.
    a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    b = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
    p = ot.ShapeProfile({"x": ((1, 8), (2, 8), (4, 8))})
    common = dict(weights_hash="random0", transforms={"precision": "fp16"}, trt_version="10.9", cap=(9, 0),
                  profile=p, component="unet")
    sa, sb = ot.structure_fingerprint(a), ot.structure_fingerprint(b)
    assert sa != sb and sa == ot.structure_fingerprint(torch.nn.Sequential(torch.nn.Linear(8, 16),
                                                                           torch.nn.Linear(16, 8)))
    assert ot.engine_key(**common, structure=sa) != ot.engine_key(**common, structure=sb)
    assert ot.engine_key(**common, structure=sa) == ot.engine_key(**common, structure=sa)
    # a dtype change is a structure change too (an fp16 export is another graph)
    assert ot.structure_fingerprint(a.half()) != sa


def test_precision_plan_for_tensorrt_10_and_11():
    trt10 = {"FP16", "BF16", "TF32", "INT8", "FP8"}
    trt11 = {"TF32", "DEBUG", "REFIT"}                 # 11.x removed FP16 / BF16 / INT8 / FP8
    assert ot.precision_plan("fp16", trt10) == (False, "FP16", "")
    assert ot.precision_plan("bf16", trt10) == (False, "BF16", "")
    assert ot.precision_plan("fp32", trt10) == (False, None, "")
    strong, flag, note = ot.precision_plan("fp16", trt11)
    assert strong and flag is None and "FP16" in note and "exported graph" in note
    assert ot.precision_plan("fp32", trt11) == (False, None, "")


def test_tensorrt_version_without_tensorrt_is_a_stable_word():
    v = ot.tensorrt_version()
    assert isinstance(v, str) and v and v == ot.tensorrt_version()
