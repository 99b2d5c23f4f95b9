"""The Train tab's "Start from a trained generator" (TrainRequest.init_g / freeze_g_kimg): the request reaches the
trainer as --init-g / --freeze-g-kimg with the generator's network, and a new run really starts from it; what the
trainer would refuse (or silently drop) is refused before anything starts. As in tests/test_train_tab_aug.py, the
manager's child is a stand-in `true`, and the trainer runs in this process on the exact argv the manager wrote to
run.json. The generators are G_ema snapshots of tiny CPU runs made here."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from core.errors import InputError
from tests.test_train_tab_aug import records, settle, trainer_argv
from tests.test_training_runs import write_tiny_dataset
from training import checkpoint as ckpt
from training import cli
from training.runs import TrainingRunManager, TrainRequest, generator_files

TRUE = shutil.which("true")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> dict:
    """Two tiny runs of 0.048 kimg with G_ema snapshots: one of the tiny preset's network ("plain") and one
    narrower (--cmax 8, "narrow"), as the bundled emoji64 model is wider than its preset's."""
    tmp = tmp_path_factory.mktemp("runs-initg")
    data = write_tiny_dataset(tmp, 24, 16)
    out = {"data": data}
    for name, extra in (("plain", []), ("narrow", ["--cmax", "8"])):
        run = tmp / name
        assert cli.main(["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu",
                         "--snapshot-ema", "--no-progress", "--kimg", "0.048", "--batch", "8", *extra]) == 0
        out[name] = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))[-1].resolve()
    out["kimg"] = json.loads(out["plain"].with_suffix(".json").read_text())["metadata"]["kimg"]
    return out


@pytest.fixture
def stand_in(tmp_path):
    """A manager whose 'python' is `true`: start() does all its checks and writes run.json, and nothing trains."""
    m = TrainingRunManager(tmp_path / "runs", python=TRUE)
    yield m
    m.stop_all(wait=True, grace_s=5)


def request(src, **kw) -> TrainRequest:
    base = dict(data=str(src["data"]), preset="tiny", batch=8, device="cpu", log_every=1,
                kimg=round(src["kimg"] + 0.032, 3))
    return TrainRequest(**{**base, **kw})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_run_from_a_generator_starts_from_it_and_trains_d_alone_first(stand_in, src):
    stand_in.start(request(src, name="cont", init_g=str(src["plain"]), freeze_g_kimg=0.016))
    run = stand_in.runs_dir / "cont"
    argv = trainer_argv(run)
    assert flag(argv, "--init-g") == str(src["plain"]) and flag(argv, "--freeze-g-kimg") == "0.016"
    assert "--cbase" not in argv and "--cmax" not in argv and "--resume" not in argv   # the preset's own width
    req = json.loads((run / "run.json").read_text())["request"]
    assert (req["init_g"], req["freeze_g_kimg"]) == (str(src["plain"]), 0.016)
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert (cfg.init_g, cfg.freeze_g_kimg) == (str(src["plain"]), 0.016)

    assert cli.main(argv) == 0                         # the run the manager would have started
    doc = ckpt.read_state(run)
    start = round(src["kimg"] * 1000)
    assert doc["freeze_until_nimg"] == start + 16      # the counters continued from the generator's kimg
    assert doc["d_updates"] == doc["step"] and doc["g_updates"] == doc["step"] - 2   # 2 D-alone iterations of 8
    (init,) = records(run, "init_g")
    assert init["from"] == str(src["plain"]) and init["kimg"] == pytest.approx(src["kimg"])


def test_a_generator_of_another_width_gets_its_network(stand_in, src):
    """The file's G is narrower than the preset's: the run builds its width (--cbase/--cmax, G and D), so the
    trainer's strict load takes it; without them the run would fail on the first tensor."""
    stand_in.start(request(src, name="narrow", init_g=str(src["narrow"])))
    run = stand_in.runs_dir / "narrow"
    argv = trainer_argv(run)
    assert (flag(argv, "--cbase"), flag(argv, "--cmax")) == ("256", "8") and "--freeze-g-kimg" not in argv
    assert cli.main(argv) == 0
    assert ckpt.read_state(run)["config"]["g_kwargs"]["channel_max"] == 8


def test_train_d_alone_without_a_generator_is_passed_as_the_trainer_allows_it(tmp_path, src):
    args = request(src, freeze_g_kimg=0.5).checked().cli_args(tmp_path / "x")
    assert flag(args, "--freeze-g-kimg") == "0.5" and "--init-g" not in args
    assert cli.config_from_args(cli.build_parser().parse_args(args)).freeze_g_kimg == 0.5
    assert "--freeze-g-kimg" not in request(src).checked().cli_args(tmp_path / "y")   # 0: nothing passed


def _not_a_generator(src, tmp):
    p = tmp / "model.pkl"
    p.write_bytes(b"not a safetensors file")
    return {"init_g": str(p)}


def _without_its_json(src, tmp):
    p = tmp / "alone.safetensors"
    shutil.copy(src["plain"], p)
    return {"init_g": str(p)}


@pytest.mark.parametrize("make, msg", [
    (lambda s, t: {"init_g": str(t / "missing.safetensors")}, "generator file not found"),
    (_not_a_generator, r"model.pkl is not an exported generator: give the .safetensors"),
    (lambda s, t: {"init_g": str(t)}, "is not an exported generator"),                      # a folder
    (_without_its_json, r"alone.safetensors has no alone.json beside it"),
    (lambda s, t: {"init_g": str(s["plain"]), "resume": True}, "Resume continues the run's own checkpoint"),
    (lambda s, t: {"init_g": str(s["plain"]), "freeze_g_kimg": -1.0}, r"must be 0 or more kimg.*got -1"),
    (lambda s, t: {"init_g": str(s["plain"]), "freeze_g_kimg": math.nan}, "must be 0 or more kimg"),
    (lambda s, t: {"freeze_g_kimg": 0.5, "resume": True}, "keeps the D-alone boundary of its checkpoint"),
    (lambda s, t: {"init_g": str(s["plain"]), "kimg": 0.04}, r"is at 0.048 kimg .* set Length above 0.048"),
    (lambda s, t: {"init_g": str(s["plain"]), "preset": "stylegan2"}, "trained with the tiny preset"),
    (lambda s, t: {"init_g": str(s["plain"]), "resolution": 32}, "makes 16x16 images"),
    (lambda s, t: {"init_g": str(s["plain"]), "cond": "group"}, "is unconditional: clear the class key"),
])
def test_bad_generator_requests_are_refused_before_anything_starts(stand_in, src, tmp_path, make, msg):
    with pytest.raises(InputError, match=msg):
        stand_in.start(request(src, name="bad", **make(src, tmp_path)))
    assert stand_in.runs() == [] and not (stand_in.runs_dir / "bad").exists()


def test_the_known_generators_are_the_studios_safetensors_by_name(tmp_path, src):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        for suffix in (".safetensors", ".json"):
            shutil.copy(src["plain"].with_suffix(suffix), folder / f"g{suffix}")
    (a / "old.pkl").write_bytes(b"an NVlabs pickle is not listed")
    shutil.copy(src["plain"], a / "bare.safetensors")          # no .json: not a studio generator
    shutil.copytree(src["plain"].parent.parent, a / "a-run")      # a run folder (state.json): not a file to load
    found = generator_files([a, b, a])
    assert found == {"g": a / "g.safetensors", "g (b)": b / "g.safetensors"}
    assert generator_files([tmp_path / "nowhere"]) == {}


# -- the Train tab --------------------------------------------------------------------------------------
def _tab(tmp_path, manager, **settings_kw):
    import gradio as gr

    from core.settings import Settings
    from ui.train_tab import build_train_tab

    settings = Settings(**{"output_dir": tmp_path / "out", "cache_dir": tmp_path / "cache",
                           "models_dirs": (tmp_path / "models",), **settings_kw})
    with gr.Blocks() as demo:
        backend, model = gr.Radio(["stylegan"], value="stylegan"), gr.Dropdown([], allow_custom_value=True)
        build_train_tab(settings, manager, backend=backend, model=model, model_update=lambda b, m: gr.skip(),
                        add_model=lambda p: p)
    fns = {f.api_name: f for f in demo.fns.values()}
    props = {c["props"].get("elem_id"): c["props"] for c in demo.get_config_file()["components"]}
    return fns, props


def _export(src, folder: Path, stem: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".safetensors", ".json"):
        shutil.copy(src["narrow"].with_suffix(suffix), folder / f"{stem}{suffix}")
    return folder / f"{stem}.safetensors"


def test_train_tab_starts_a_run_from_a_listed_generator(stand_in, src, tmp_path):
    import gradio as gr

    from ui.train_tab import TrainView

    mine = _export(src, tmp_path / "models", "mine")           # what Export to studio wrote
    fns, props = _tab(tmp_path, stand_in)
    box, pick, freeze = props["train-init"], props["train-init-g"], props["train-freeze-g-kimg"]
    assert box["label"] == "Start from a trained generator" and box["open"] is False
    assert "D starts fresh" in props["train-init-note"]["value"] and "400 kimg" in props["train-init-note"]["value"]
    choices = [tuple(c) for c in pick["choices"]]
    assert pick["value"] == "" and choices[0] == ("none: a new G", "")
    assert ("mine (0.048 kimg)", "mine") in choices and ("emoji64 (3481.6 kimg)", "emoji64") in choices  # + bundled
    assert str(tmp_path) not in json.dumps(pick)               # names, not server paths
    assert freeze["value"] == 0 and freeze["label"] == "Train D alone first (kimg)"

    start, view = fns["train_start"].fn, TrainView()
    start(data=str(src["data"]), preset="tiny", batch=8, kimg=1, name="picked", init_g="mine", freeze_g_kimg=0.016,
          view=view)
    settle(stand_in)
    argv = trainer_argv(stand_in.runs_dir / "picked")
    assert flag(argv, "--init-g") == str(mine.resolve()) and flag(argv, "--freeze-g-kimg") == "0.016"
    assert flag(argv, "--cmax") == "8"
    with pytest.raises(gr.Error, match="Resume continues the run's own checkpoint"):
        start(data=str(src["data"]), preset="tiny", name="picked", resume=True, init_g="mine", view=view)
    # the untouched accordion sends "" and 0: no generator, as before
    start(data=str(src["data"]), preset="tiny", batch=8, name="plain", view=view,
          init_g=pick["value"], freeze_g_kimg=freeze["value"])
    assert not {"--init-g", "--freeze-g-kimg"} & set(trainer_argv(stand_in.runs_dir / "plain"))

    # a model exported later is listed when the accordion opens again
    _export(src, tmp_path / "models", "later")
    update = fns["train_generators"].fn("mine")
    assert ("later (0.048 kimg)", "later") in [tuple(c) for c in update.choices] and update.value == "mine"


def test_public_train_tab_takes_listed_generators_or_files_in_the_data_folders(stand_in, src, tmp_path):
    import gradio as gr

    from ui.train_tab import TrainView

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    shutil.copy(src["data"], data_dir / "tiny16.npy")
    _export(src, tmp_path / "models", "mine")
    _export(src, data_dir, "shared")                                # a visitor's generator among the data
    fns, _ = _tab(tmp_path, stand_in, mode="public", allow=frozenset({"train"}), data_dirs=(data_dir,))
    start, view = fns["train_start"].fn, TrainView()
    base = dict(data="tiny16.npy", preset="tiny", batch=8, kimg=1, view=view)
    for name, init_g, path in (("listed", "mine", tmp_path / "models" / "mine.safetensors"),
                               ("shared", "shared.safetensors", data_dir / "shared.safetensors")):
        start(**base, name=name, init_g=init_g)
        settle(stand_in)
        assert flag(trainer_argv(stand_in.runs_dir / name), "--init-g") == str(path.resolve())
    for elsewhere in (str(src["narrow"]), "../models/mine.safetensors"):   # any other server path
        with pytest.raises(gr.Error, match="one of the listed models, or a .safetensors file inside the host's"):
            start(**base, name="elsewhere", init_g=elsewhere)
    assert not (stand_in.runs_dir / "elsewhere").exists()
