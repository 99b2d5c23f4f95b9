"""Loading diffusion models: detection, bundled configs, single files (A1111 layout), pickles, damaged
files, NaN weights, the HF cache offline, the catalogue scan."""
from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from core.errors import ModelLoadError, UnsafeModelError
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags
from models import diffusion_catalogue as dcat
from pipelines.diffusion import DiffusionPipeline, clip_tokenizer, load_diffusion
from tests.diffusion_tiny import build_tiny_sd, build_tiny_sdxl, open_clip_to_ldm, pipeline_to_ldm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusion-loading")
    sd = build_tiny_sd(root / "tiny-sd")
    sdxl = build_tiny_sdxl(root / "tiny-sdxl")
    save_file(pipeline_to_ldm(sd), str(root / "tiny-sd-single.safetensors"))
    save_file(pipeline_to_ldm(sdxl), str(root / "tiny-sdxl-single.safetensors"))
    return root


def run(loaded, **kw):
    p = DiffusionParams(**{**dict(prompt="a red fox in snow", seed=3, steps=2, guidance=5.0, width=64, height=64), **kw})
    return DiffusionPipeline(loaded, OptimizationFlags(), CPU).generate(GenerationRequest("diffusion", loaded.ref, p), Job())


def assert_same_images(a, b) -> None:
    """Two loads of one model from different files (single file or .ckpt against the folder) build their
    modules separately: the same image to float rounding (pixels in [0, 1]), not necessarily bit for bit.
    A weight lost or misplaced by the conversion changes pixels by far more."""
    assert a.raw.shape == b.raw.shape
    np.testing.assert_allclose(a.raw, b.raw, rtol=0, atol=1e-5)


# -- detection --------------------------------------------------------------------------------------------------

UNET_IN = "model.diffusion_model.input_blocks.0.0.weight"


def keys(*prefixes, in_ch=4):
    d = {UNET_IN: (320, in_ch, 3, 3), "model.diffusion_model.input_blocks.1.0.in_layers.0.weight": (320,)}
    d.update({p + "x.weight": (8,) for p in prefixes})
    return d


@pytest.mark.parametrize("prefixes, name, arch, probe", [
    (("cond_stage_model.transformer.text_model.",), "v1-5-pruned-emaonly.safetensors", "sd15", False),
    (("cond_stage_model.model.",), "v2-1_512-ema-pruned.safetensors", "sd2", False),
    (("cond_stage_model.model.",), "v2-1_768-ema-pruned.safetensors", "sd2-v", False),
    (("cond_stage_model.model.",), "myMix_vpred.safetensors", "sd2-v", False),
    (("cond_stage_model.model.",), "sd_turbo.safetensors", "sd-turbo", False),
    (("cond_stage_model.model.",), "someSD2finetune.safetensors", "sd2", True),
    (("conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."), "sd_xl_base_1.0.safetensors", "sdxl", False),
    (("conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."), "sd_xl_turbo_1.0_fp16.safetensors", "sdxl-turbo", False),
])
def test_detect_from_single_file_keys(prefixes, name, arch, probe):
    det = dcat.detect_from_keys(keys(*prefixes), name)
    assert (det.arch, det.needs_v_probe) == (arch, probe)


@pytest.mark.parametrize("shapes, match", [
    (keys("conditioner.embedders.0.model."), "SDXL refiner"),
    (keys("cond_stage_model.transformer.", in_ch=9), "inpainting"),
    (keys("cond_stage_model.transformer.", in_ch=8), "instruct-pix2pix"),
    ({"lora_unet_down_blocks_0.lora_up.weight": (4, 4)}, "LoRA"),
    ({"model.diffusion_model.joint_blocks.0.x.weight": (4,)}, "Stable Diffusion 3"),
    ({"encoder.down.0.block.0.conv1.weight": (4,)}, "VAE on its own"),
    ({"emb_params": (2, 768)}, "no Stable Diffusion UNet"),
    (keys(), "no text encoder"),
])
def test_detect_refuses_what_it_cannot_run(shapes, match):
    with pytest.raises(ModelLoadError, match=match):
        dcat.detect_from_keys(shapes, "file.safetensors")


def test_detect_from_folders(tiny):
    assert dcat.detect_from_folder(tiny / "tiny-sd").arch == "sd15"
    assert dcat.detect_from_folder(tiny / "tiny-sdxl").arch == "sdxl"
    for arch in dcat.ARCHS:
        assert dcat.detect_from_folder(dcat.config_dir(arch)).arch == arch


def test_bundled_configs_build_the_published_architectures():
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    expected = {"sd15": (859_520_964, 123_060_480, None), "sd2-v": (865_910_724, 340_387_840, None),
                "sdxl": (2_567_463_684, 123_060_480, 694_659_840)}
    for arch, (unet_n, te_n, te2_n) in expected.items():
        d = dcat.config_dir(arch)
        with init_empty_weights():
            assert count(UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(d, subfolder="unet"))) == unet_n
            assert count(AutoencoderKL.from_config(AutoencoderKL.load_config(d, subfolder="vae"))) == 83_653_863
            assert count(CLIPTextModel(CLIPTextConfig.from_pretrained(d / "text_encoder"))) == te_n
            if te2_n:
                assert count(CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(d / "text_encoder_2"))) == te2_n


def test_bundled_clip_tokenizer_matches_openai_clip_ids():
    tok = clip_tokenizer(dcat.config_dir("sd15") / "tokenizer")
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(tok) == 49408 and tok.model_max_length == 77
    tok2 = clip_tokenizer(dcat.config_dir("sdxl") / "tokenizer_2")
    assert tok2("a cat", padding="max_length").input_ids[:5] == [49406, 320, 2368, 49407, 0]   # pads with '!'


def test_missing_clip_vocab_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(dcat, "CLIP_MERGES_FILE", tmp_path / "clip_merges.txt.gz")
    dcat.clip_vocab_and_merges.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match="clip_merges.txt.gz is missing"):
            clip_tokenizer(tmp_path / "tokenizer")
    finally:
        dcat.clip_vocab_and_merges.cache_clear()


# -- single files -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sdxl"])
def test_single_file_loads_like_the_folder(tiny, name):
    f = tiny / f"{name}-single.safetensors"
    single = load_diffusion(str(f), single_file_config=tiny / name)
    folder = load_diffusion(str(tiny / name))
    assert single.source == "single-file" and single.arch == folder.arch
    assert single.hash == hashlib.sha256(f.read_bytes()).hexdigest()[:10]     # A1111's "Model hash"
    assert single.size_bytes == f.stat().st_size
    assert_same_images(run(single), run(folder))


def test_single_file_with_bundled_config_fails_clearly_on_wrong_sizes(tiny):
    # The tiny UNet is not the 860M SD 1.5 UNet the bundled config describes: a clear error, not a crash.
    with pytest.raises(ModelLoadError, match="do not fit the sd15 layout"):
        load_diffusion(str(tiny / "tiny-sd-single.safetensors"))


@pytest.mark.parametrize("bias, arch, prediction", [(-2.0, "sd2-v", "v_prediction"), (0.5, "sd2", "epsilon")])
def test_sd2_single_file_epsilon_or_v_is_probed(tiny, tmp_path, bias, arch, prediction):
    # An SD 2.x file (OpenCLIP text tower) whose name says nothing: one UNet call at t=999 decides.
    # A UNet that returns its input is an ε-model; one that returns about -x0 is a v-model.
    pipe = load_diffusion(str(tiny / "tiny-sd")).pipe
    with torch.no_grad():
        pipe.unet.conv_out.weight.zero_()
        pipe.unet.conv_out.bias.fill_(bias)
    sd = {k: v for k, v in pipeline_to_ldm(pipe).items() if not k.startswith("cond_stage_model.")}
    te = {"text_model." + k: v for k, v in pipe.text_encoder.state_dict().items()}
    sd.update(open_clip_to_ldm(te, "cond_stage_model.model."))
    f = tmp_path / "my-finetune.safetensors"
    save_file(sd, str(f))
    assert dcat.detect_from_keys(dcat.safetensors_shapes(f), f.name).needs_v_probe
    loaded = load_diffusion(str(f), single_file_config=tiny / "tiny-sd")
    assert loaded.arch == arch and loaded.pipe.scheduler.config.prediction_type == prediction
    assert any("by a one-step probe" in n for n in loaded.notes)
    assert torch.equal(loaded.pipe.text_encoder.state_dict()["embeddings.token_embedding.weight"],
                       pipe.text_encoder.state_dict()["embeddings.token_embedding.weight"])


def test_ckpt_read_weights_only(tiny, tmp_path):
    sd = pipeline_to_ldm(load_diffusion(str(tiny / "tiny-sd")).pipe)
    ckpt = tmp_path / "tiny.ckpt"
    torch.save({"state_dict": sd, "global_step": 1000}, ckpt)
    loaded = load_diffusion(str(ckpt), single_file_config=tiny / "tiny-sd")
    assert loaded.arch == "sd15"
    assert_same_images(run(loaded), run(load_diffusion(str(tiny / "tiny-sd"))))


class Payload:
    """Stands for a pickle that carries an object: with a weights-only load it is never built."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_ckpt_with_objects_is_refused(tmp_path, capsys):
    bad = tmp_path / "evil.ckpt"
    with bad.open("wb") as f:
        pickle.dump({"state_dict": {"x": torch.zeros(1)}, "hook": Payload()}, f)
    with pytest.raises(UnsafeModelError, match="refused"):
        load_diffusion(str(bad))
    assert "must never run" not in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"", b"garbage that is not a checkpoint", b"\xff" * 64])
def test_garbage_safetensors_is_refused(tmp_path, content):
    f = tmp_path / "broken.safetensors"
    f.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_diffusion(str(f))


def test_truncated_safetensors_is_refused(tiny, tmp_path):
    data = (tiny / "tiny-sd-single.safetensors").read_bytes()
    f = tmp_path / "truncated.safetensors"
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_diffusion(str(f), single_file_config=tiny / "tiny-sd")


def test_garbage_ckpt_is_refused(tmp_path):
    f = tmp_path / "broken.ckpt"
    f.write_bytes(b"PK\x03\x04 this is not a zip")
    with pytest.raises(ModelLoadError, match="not a readable PyTorch checkpoint"):
        load_diffusion(str(f))


def test_nan_weights_in_a_single_file_are_refused(tiny, tmp_path):
    sd = pipeline_to_ldm(load_diffusion(str(tiny / "tiny-sd")).pipe)
    key = "model.diffusion_model.out.2.weight"
    sd[key][0, 0, 0, 0] = float("nan")
    f = tmp_path / "nan.safetensors"
    save_file(sd, str(f))
    with pytest.raises(ModelLoadError, match=r"NaN/Inf weights in model\.diffusion_model\.out\.2\.weight \(1 values\)"):
        load_diffusion(str(f), single_file_config=tiny / "tiny-sd")


def test_inf_weights_in_a_folder_are_refused(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "inf-sd"
    shutil.copytree(tiny / "tiny-sd", folder)
    wfile = folder / "vae" / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(wfile))
    sd["decoder.conv_out.bias"][0] = float("inf")
    save_file(sd, str(wfile))
    with pytest.raises(ModelLoadError, match=r"vae\.decoder\.conv_out\.bias"):
        load_diffusion(str(folder))


def test_missing_paths_and_bad_refs(tmp_path):
    with pytest.raises(ModelLoadError, match="no file or folder"):
        load_diffusion(str(tmp_path / "nothing.safetensors"))
    with pytest.raises(ModelLoadError, match="no diffusion model given"):
        load_diffusion("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="model_index.json"):
        load_diffusion(str(tmp_path / "empty"))


def test_weights_dtype_follows_precision_flag(tiny):
    loaded = load_diffusion(str(tiny / "tiny-sd"), flags=OptimizationFlags(precision="bf16"))
    assert loaded.pipe.unet.dtype == torch.bfloat16 and loaded.pipe.vae.dtype == torch.bfloat16
    cpu_fp16 = load_diffusion(str(tiny / "tiny-sd"), device="cpu", flags=OptimizationFlags(precision="fp16"))
    assert cpu_fp16.pipe.unet.dtype == torch.float32        # fp16 kernels do not pay off on a CPU
    res = run(loaded)
    assert np.isfinite(res.raw).all() and res.metadata[0]["dtype"] == "bfloat16"


# -- the Hugging Face cache, offline ----------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hf_cache(src: Path, cache: Path, repo_id: str) -> Path:
    """Lay `src` out as huggingface_hub does: blobs named by hash, snapshot links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for f in src.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo / "snapshots" / COMMIT / f.relative_to(src)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, link.parent), link)
    return repo


def test_hub_id_from_the_cache_offline(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_hf_cache(tiny / "tiny-sd", tmp_path / "hub", "atelier-test/tiny-sd")
    loaded = load_diffusion("atelier-test/tiny-sd", hf_cache_dir=tmp_path / "hub")
    assert (loaded.source, loaded.arch, loaded.hash) == ("hf-cache", "sd15", COMMIT[:10])
    assert np.array_equal(run(loaded).raw, run(load_diffusion(str(tiny / "tiny-sd"))).raw)
    entries = dcat.scan_hf_cache(tmp_path / "hub")
    assert [(e.id, e.kind, e.source) for e in entries] == [("atelier-test/tiny-sd", "sd15", "hf-cache")]
    assert entries[0].size_bytes and entries[0].size_bytes > 0
    # the catalogue hands the snapshot path to the loader: it is still named by its hub id and commit
    by_path = load_diffusion(entries[0].path)
    assert (by_path.ref, by_path.source, by_path.hash) == ("atelier-test/tiny-sd", "hf-cache", COMMIT[:10])


def test_hub_id_not_in_cache_offline_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        load_diffusion("stabilityai/sd-turbo", hf_cache_dir=tmp_path / "empty-cache")
    msg = str(err.value)
    assert "stabilityai/sd-turbo" in msg and "not in the local cache" in msg and "huggingface-cli download" in msg


# -- the catalogue ------------------------------------------------------------------------------------------------

def test_scan_finds_folders_and_single_files(tiny, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-sd").symlink_to(tiny / "tiny-sd", target_is_directory=True)
    (models / "mix.safetensors").symlink_to(tiny / "tiny-sdxl-single.safetensors")
    save_file({"lora_unet_down.lora_up.weight": torch.zeros(2, 2)}, str(models / "style-lora.safetensors"))
    entries = {Path(e.id).name: e for e in dcat.scan_diffusion_models([models], include_hf_cache=False)}
    assert set(entries) == {"tiny-sd", "mix.safetensors"}, "a LoRA is not offered as a model"
    assert (entries["tiny-sd"].kind, entries["tiny-sd"].source) == ("sd15", "local")
    assert entries["mix.safetensors"].kind == "sdxl" and entries["mix.safetensors"].size_bytes > 0
    assert all(e.backend == "diffusion" for e in entries.values())


def test_known_hub_models_say_what_they_need():
    ids = {e.id for e in dcat.KNOWN_HUB_MODELS}
    assert {"stabilityai/sd-turbo", "stabilityai/stable-diffusion-xl-base-1.0", "stabilityai/sdxl-turbo",
            "stabilityai/stable-diffusion-2-1", "stable-diffusion-v1-5/stable-diffusion-v1-5"} <= ids
    for e in dcat.KNOWN_HUB_MODELS:
        assert e.source == "hub" and e.kind in dcat.ARCHS and e.license and e.size_bytes > 10**9
