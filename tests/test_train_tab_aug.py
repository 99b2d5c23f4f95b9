"""The augmentation guards, --retune, the class balance and NoisyTwins from the Train tab and `TrainRequest`: the
pipe (upright = no flips or rotations), the cap on ADA's p, a retuned resume, --class-balance and --noisy-twins
reach the trainer's config; left alone they keep the preset's values (and the command as it was); bad input is
refused before anything starts. No waiting on a child: the trainer runs in this process on the exact argv the
manager would start it with (or wrote to run.json), and the manager's children are a stand-in `true` that trains
nothing."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from core.errors import InputError
from tests.test_training_runs import write_tiny_dataset
from training import cli
from training.runs import TrainingRunManager, TrainRequest

TRUE = shutil.which("true")


def child_config(req: TrainRequest, out: Path):
    """(TrainConfig, retune dict) that `python -m training.cli` builds from the request's command line."""
    args = cli.build_parser().parse_args(req.checked().cli_args(out))
    return cli.config_from_args(args), cli.retune_from_args(args)


def trainer_argv(run: Path) -> list[str]:
    """The `training.cli` arguments the manager started the run with (run.json's argv, after `python -u -m`)."""
    argv = json.loads((run / "run.json").read_text())["argv"]
    assert argv[1:4] == ["-u", "-m", "training.cli"], argv
    return argv[4:]


def settle(m: TrainingRunManager) -> None:
    """Wait for the stand-in children to exit: start() refuses a new run while one is alive, and on a loaded
    machine `true` may not have exited by the next call."""
    for child in list(m._children.values()):
        child.proc.wait(timeout=120)


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if r.get("kind") == kind]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("aug-data"))


@pytest.fixture(scope="module")
def labels(data) -> Path:
    """Class indices for the 24 images of `data` under "group": 16, 6 and 2 images (a long tail)."""
    lab = data.parent / "labels.json"
    lab.write_text(json.dumps({"group": [0] * 16 + [1] * 6 + [2] * 2, "groups": ["many", "some", "few"]}))
    return lab


@pytest.fixture
def stand_in(tmp_path):
    """A manager whose 'python' is `true`: start() does all its checks and writes run.json, and nothing trains."""
    m = TrainingRunManager(tmp_path / "runs", python=TRUE)
    yield m
    m.stop_all(wait=True, grace_s=5)


def test_unset_fields_keep_the_presets_guards(tmp_path, data):
    cfg, retune = child_config(TrainRequest(preset="emoji64"), tmp_path / "e")
    assert (cfg.aug_pipe, cfg.ada_max_p) == ("upright", 0.6) and retune is None
    cfg, _ = child_config(TrainRequest(data=str(data), preset="stylegan2"), tmp_path / "s")
    assert (cfg.aug_pipe, cfg.ada_max_p) == ("bgc", 1.0)
    args = TrainRequest(data=str(data), preset="stylegan2").checked().cli_args(tmp_path / "s")
    assert not {"--aug-pipe", "--ada-max-p", "--retune"} & set(args)


def test_given_fields_override_the_preset(tmp_path, data):
    req = TrainRequest(preset="emoji64", aug_pipe="bgc", ada_max_p=0.9, aug="fixed", aug_p=0.8)
    cfg, _ = child_config(req, tmp_path / "e")
    assert (cfg.aug_pipe, cfg.ada_max_p, cfg.aug, cfg.aug_p) == ("bgc", 0.9, "fixed", 0.8)
    cfg, _ = child_config(TrainRequest(data=str(data), preset="stylegan2", aug_pipe=" upright ", ada_max_p=0.5),
                          tmp_path / "s")
    assert (cfg.aug_pipe, cfg.ada_max_p) == ("upright", 0.5)


@pytest.mark.parametrize("kw, msg", [
    (dict(ada_max_p=1.5), r"\(Max p\) must be in \(0, 1\], or 0 for the preset's .*got 1.5"),
    (dict(ada_max_p=-0.2), r"must be in \(0, 1\]"),
    (dict(ada_max_p=math.nan), r"must be in \(0, 1\]"),
    (dict(aug_pipe="sideways"), r"pipe must be one of blit, geom, color, bg, bgc, bgcc, upright .*'sideways'"),
    (dict(retune=True), "tick Resume it as well"),
    (dict(retune=True, batch=16), "tick Resume it as well"),
    (dict(aug="fixed", aug_p=0.8, ada_max_p=0.5), r"p 0.8 is above the cap on ADA's p \(Max p\) 0.5; .*raise Max p to 0.8"),
    (dict(preset="emoji64", data="", aug_p=0.7), r"\(Max p\) 0.6 \(the emoji64 preset's\)"),
])
def test_bad_guard_settings_are_refused_before_anything_starts(stand_in, data, kw, msg):
    with pytest.raises(InputError, match=msg):
        stand_in.start(TrainRequest(**{"data": str(data), "preset": "tiny", "name": "bad", **kw}))
    assert stand_in.runs() == [] and not (stand_in.runs_dir / "bad").exists()


def test_resumed_then_retuned_run_takes_the_new_guards(stand_in, data, capsys):
    run = stand_in.runs_dir / "guarded"
    first = TrainRequest(data=str(data), preset="tiny", kimg=0.016, log_every=1, device="cpu", name="guarded",
                         aug_pipe="upright", ada_max_p=0.5)
    assert cli.main(first.checked().cli_args(run)) == 0                    # the run the manager would start
    state = json.loads((run / "state.json").read_text())
    assert (state["config"]["aug_pipe"], state["config"]["ada_max_p"]) == ("upright", 0.5)
    assert state["aug_p"] <= 0.5

    # a plain resume would drop new guards without a word: refused, the run untouched
    before = (run / "state.json").read_bytes()
    with pytest.raises(InputError, match=r"plain resume keeps the run's recipe, so augmentation pipe 'bgc' "
                                         r"\(the run's: 'upright'\), Max p 0.3 \(the run's: 0.5\) would be "
                                         r"ignored; tick Retune"):
        stand_in.start(TrainRequest(preset="tiny", name="guarded", resume=True, aug_pipe="bgc", ada_max_p=0.3))
    assert (run / "state.json").read_bytes() == before and not (run / "run.json").exists()

    # the same values as the run's, or none, resume as before
    retuned = TrainRequest(preset="tiny", name="guarded", resume=True, retune=True, kimg=0.032, log_every=1,
                           device="cpu", aug_pipe="bgc", ada_max_p=0.3)
    stand_in.start(retuned)
    argv = trainer_argv(run)
    assert "--retune" in argv and argv[argv.index("--aug-pipe") + 1] == "bgc"
    assert argv[argv.index("--ada-max-p") + 1] == "0.3"
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    state = json.loads((run / "state.json").read_text())
    assert (state["config"]["aug_pipe"], state["config"]["ada_max_p"]) == ("bgc", 0.3)
    assert state["aug_p"] <= 0.3 and state["kimg"] >= 0.032
    (change,) = records(run, "retune")
    assert change["changed"]["aug_pipe"] == {"from": "upright", "to": "bgc"}
    assert change["changed"]["ada_max_p"] == {"from": 0.5, "to": 0.3}
    assert "aug" not in change["changed"]                 # the form's 'ada' is the run's: nothing to change


def test_plain_resume_with_the_runs_own_guards_is_accepted(stand_in, data, tmp_path):
    run = stand_in.runs_dir / "same"
    run.mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"config": {"aug_pipe": "upright", "ada_max_p": 0.6, "batch": 8,
                                                           "d_steps": 1}}))
    stand_in.start(TrainRequest(preset="tiny", name="same", resume=True, aug_pipe="upright", ada_max_p=0.6, batch=8))
    argv = trainer_argv(run)
    assert "--retune" not in argv and "--resume" in argv


def _tab(tmp_path, manager):
    import gradio as gr

    from core.settings import Settings
    from ui.train_tab import build_train_tab

    settings = Settings(output_dir=tmp_path / "out", cache_dir=tmp_path / "cache", models_dirs=())
    with gr.Blocks() as demo:
        backend, model = gr.Radio(["stylegan"], value="stylegan"), gr.Dropdown([], allow_custom_value=True)
        build_train_tab(settings, manager, backend=backend, model=model, model_update=lambda b, m: gr.skip(),
                        add_model=lambda p: p)
    start = next(f for f in demo.fns.values() if f.api_name == "train_start")
    return demo, start


def test_train_tab_has_the_controls_and_its_defaults_keep_the_preset(stand_in, tmp_path):
    import gradio as gr

    from ui.train_tab import START_FIELDS, TrainView

    demo, start = _tab(tmp_path, stand_in)
    props = {c["props"].get("elem_id"): c["props"] for c in demo.get_config_file()["components"]}
    pipe, cap, retune = props["train-aug-pipe"], props["train-ada-max-p"], props["train-retune"]
    choices = [tuple(c) for c in pipe["choices"]]
    assert pipe["value"] == "" and choices[0] == ("preset's", "") and ("upright", "upright") in choices
    assert cap["value"] == 0 and (cap["minimum"], cap["maximum"]) == (0, 1)
    assert retune["value"] is False
    # appended: older API calls keep their order
    assert START_FIELDS[-10:] == ("aug_pipe", "ada_max_p", "retune", "cond", "labels", "init_g", "freeze_g_kimg",
                                  "class_balance", "noisy_twins", "noisy_twins_sigma")

    view = TrainView()
    with pytest.raises(gr.Error, match="tick Resume it as well"):
        start.fn(data="", preset="emoji64", retune=True, view=view)
    with pytest.raises(gr.Error, match="must be in"):
        start.fn(data="", preset="emoji64", ada_max_p=2.0, view=view)
    # what the browser sends when the new controls are left alone
    defaults = {k: props[f"train-{k.replace('_', '-')}"]["value"] for k in ("aug_pipe", "ada_max_p", "retune")}
    start.fn(data="", preset="emoji64", kimg=1, name="emoji", view=view, **defaults)
    argv = trainer_argv(stand_in.runs_dir / "emoji")
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert (cfg.aug_pipe, cfg.ada_max_p) == ("upright", 0.6)
    req = json.loads((stand_in.runs_dir / "emoji" / "run.json").read_text())["request"]
    assert (req["aug_pipe"], req["ada_max_p"], req["retune"]) == ("", 0.0, False)


def test_train_tab_passes_the_guards_it_is_given(stand_in, tmp_path, data):
    from ui.train_tab import TrainView

    _, start = _tab(tmp_path, stand_in)
    start.fn(data=str(data), preset="tiny", name="given", aug_pipe="upright", ada_max_p=0.45, view=TrainView())
    cfg = cli.config_from_args(cli.build_parser().parse_args(trainer_argv(stand_in.runs_dir / "given")))
    assert (cfg.aug_pipe, cfg.ada_max_p) == ("upright", 0.45)


def test_train_tab_starts_a_class_conditional_run(stand_in, tmp_path):
    """The Classes accordion: a class key (and a labels file, or the preset's / the data's dataset.json) reaches
    the trainer as --cond / --labels; a labels file without a key, or one that is not there, is refused."""
    import gradio as gr

    from ui.train_tab import TrainView

    demo, start = _tab(tmp_path, stand_in)
    props = {c["props"].get("elem_id"): c["props"] for c in demo.get_config_file()["components"]}
    assert props["train-cond"]["value"] == "" and props["train-labels"]["value"] == ""
    view = TrainView()
    start.fn(data="", preset="emoji64", kimg=1, name="emoji-cond", cond="group", view=view)
    argv = trainer_argv(stand_in.runs_dir / "emoji-cond")
    assert argv[argv.index("--cond") + 1] == "group" and "--labels" not in argv     # the preset's labels
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv))
    assert cfg.cond == "group" and cfg.labels.endswith("emoji64_labels.json")
    with pytest.raises(gr.Error, match="only for class-conditional training"):
        start.fn(data="", preset="emoji64", kimg=1, name="x1", labels="assets/datasets/emoji64_labels.json", view=view)
    with pytest.raises(gr.Error, match="labels file not found"):
        start.fn(data="", preset="emoji64", kimg=1, name="x2", cond="group", labels=str(tmp_path / "no.json"),
                 view=view)
    with pytest.raises(gr.Error, match="class key"):
        start.fn(data="", preset="emoji64", kimg=1, name="x3", cond="group/../x", view=view)
    labels = tmp_path / "mine.json"
    labels.write_text(json.dumps({"style": [i % 2 for i in range(3916)]}))
    start.fn(data="", preset="emoji64", kimg=1, name="emoji-style", cond="style", labels=str(labels), view=view)
    argv = trainer_argv(stand_in.runs_dir / "emoji-style")
    assert argv[argv.index("--labels") + 1] == str(labels) and argv[argv.index("--cond") + 1] == "style"


# -- class balance (--class-balance) --------------------------------------------------------------------
def test_class_balance_is_passed_only_when_set(tmp_path, data, labels):
    cond = dict(data=str(data), preset="tiny", cond="group", labels=str(labels))
    args = TrainRequest(**cond, class_balance=0.5).checked().cli_args(tmp_path / "b")
    assert args[args.index("--class-balance") + 1] == "0.5"
    cfg, retune = child_config(TrainRequest(**cond, class_balance=0.5), tmp_path / "b")
    assert cfg.class_balance == pytest.approx(0.5) and cfg.cond == "group" and retune is None
    before = TrainRequest(**cond).checked().cli_args(tmp_path / "z")          # a request that never mentions it
    assert "--class-balance" not in before
    assert TrainRequest(**cond, class_balance=0.0).checked().cli_args(tmp_path / "z") == before
    assert child_config(TrainRequest(**cond), tmp_path / "z")[0].class_balance == 0
    # emoji64 with the preset's labels and a conditional generator's own class key count as conditional too
    cfg, _ = child_config(TrainRequest(preset="emoji64", cond="class", class_balance=1.0), tmp_path / "e")
    assert cfg.class_balance == pytest.approx(1.0)


@pytest.mark.parametrize("kw, msg", [
    (dict(class_balance=0.5), r"class balance \(0.5\) .* this run is unconditional .* set Class balance to 0"),
    (dict(class_balance=1.5, cond="group"), r"class balance must be between 0 and 1 .*got 1.5"),
    (dict(class_balance=-0.05, cond="group"), r"class balance must be between 0 and 1"),
    (dict(class_balance=math.nan, cond="group"), r"class balance must be between 0 and 1"),
    (dict(class_balance=2.0), r"class balance must be between 0 and 1"),      # the range first: one fix at a time
])
def test_bad_class_balance_is_refused_before_anything_starts(stand_in, data, labels, kw, msg):
    lab = {"labels": str(labels)} if kw.get("cond") else {}
    with pytest.raises(InputError, match=msg):
        stand_in.start(TrainRequest(**{"data": str(data), "preset": "tiny", "name": "bad", **lab, **kw}))
    assert stand_in.runs() == [] and not (stand_in.runs_dir / "bad").exists()


def _saved_run(manager: TrainingRunManager, name: str, **config) -> Path:
    run = manager.runs_dir / name
    run.mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"config": {"batch": 8, "d_steps": 1, **config}}))
    return run


def test_a_resumed_run_takes_a_class_balance_only_with_retune_and_classes(stand_in):
    _saved_run(stand_in, "cond", cond="group", class_balance=0.0)
    _saved_run(stand_in, "older", cond="group")                      # saved before the option: it trained at 0
    _saved_run(stand_in, "uncond", cond="")
    for name in ("cond", "older"):
        with pytest.raises(InputError, match=r"plain resume keeps the run's recipe, so class balance 0.5 "
                                             r"\(the run's: 0\) would be ignored; tick Retune"):
            stand_in.start(TrainRequest(preset="tiny", name=name, resume=True, class_balance=0.5))
    for retune in (False, True):
        with pytest.raises(InputError, match=r"the run 'uncond' is unconditional .* set Class balance to 0"):
            stand_in.start(TrainRequest(preset="tiny", name="uncond", resume=True, retune=retune, class_balance=0.5))
    assert not any((stand_in.runs_dir / n / "run.json").exists() for n in ("cond", "older", "uncond"))

    stand_in.start(TrainRequest(preset="tiny", name="cond", resume=True, retune=True, class_balance=0.5))
    argv = trainer_argv(stand_in.runs_dir / "cond")
    assert "--retune" in argv and argv[argv.index("--class-balance") + 1] == "0.5" and "--cond" not in argv
    settle(stand_in)
    stand_in.start(TrainRequest(preset="tiny", name="uncond", resume=True))   # 0: resumes as before
    assert "--class-balance" not in trainer_argv(stand_in.runs_dir / "uncond")


def test_train_tab_trains_a_class_balanced_conditional_run(tmp_path, data, labels, capsys):
    """The Class balance slider under Classes (conditional): refused without a class key or outside [0, 1]
    (the form is no output of Start, so it keeps what was typed), passed as --class-balance otherwise, and the
    run it starts (here in this process, on the argv the manager wrote) trains with it and can be retuned."""
    import gradio as gr

    from ui.train_tab import START_FIELDS, TrainView

    m = TrainingRunManager(tmp_path / "runs", python=TRUE, device="cpu")
    try:
        demo, start = _tab(tmp_path, m)
        props = {c["props"].get("elem_id"): c["props"] for c in demo.get_config_file()["components"]}
        bal = props["train-class-balance"]
        assert bal["label"] == "Class balance" and bal["value"] == 0
        assert (bal["minimum"], bal["maximum"], bal["step"]) == (0, 1, 0.05)
        for words in ("0 = classes as often as your images have them", "0.5 = square-root (small classes more often)",
                      "1 = every class equally often", "only for class-conditional runs"):
            assert words in bal["info"]
        assert START_FIELDS[-3:] == ("class_balance", "noisy_twins", "noisy_twins_sigma")     # appended
        fields = {id(c) for c in start.inputs}
        assert not fields & {id(c) for c in start.outputs}

        view = TrainView()
        base = dict(data=str(data), preset="tiny", batch=8, kimg=0.016, log_every=1, view=view)
        with pytest.raises(gr.Error, match="this run is unconditional"):
            start.fn(**base, name="no-key", class_balance=0.5)
        with pytest.raises(gr.Error, match="between 0 and 1"):
            start.fn(**base, name="too-much", cond="group", labels=str(labels), class_balance=1.5)
        assert m.runs() == []

        start.fn(**base, name="balanced", cond="group", labels=str(labels), class_balance=0.5)
        settle(m)
        run = m.runs_dir / "balanced"
        argv = trainer_argv(run)
        assert argv[argv.index("--class-balance") + 1] == "0.5" and argv[argv.index("--cond") + 1] == "group"
        assert json.loads((run / "run.json").read_text())["request"]["class_balance"] == pytest.approx(0.5)
        capsys.readouterr()
        assert cli.main(argv) == 0, capsys.readouterr().err             # the run the tab started
        assert "3 classes (group), class balance 0.5" in capsys.readouterr().out
        config = json.loads((run / "state.json").read_text())["config"]
        assert config["class_balance"] == pytest.approx(0.5) and config["cond"] == "group"

        # Resume it + Retune with another balance: the run's classes, the new balance
        start.fn(**{**base, "kimg": 0.032}, name="balanced", resume=True, retune=True, class_balance=1.0)
        settle(m)
        argv = trainer_argv(run)
        assert "--retune" in argv and argv[argv.index("--class-balance") + 1] == "1"
        assert cli.main(argv) == 0, capsys.readouterr().err
        assert json.loads((run / "state.json").read_text())["config"]["class_balance"] == pytest.approx(1.0)
        (change,) = records(run, "retune")
        assert set(change["changed"]) == {"class_balance"}

        # the slider left alone: the command as before
        start.fn(**base, name="unbalanced", cond="group", labels=str(labels), class_balance=bal["value"])
        assert "--class-balance" not in trainer_argv(m.runs_dir / "unbalanced")
    finally:
        m.stop_all(wait=True, grace_s=5)


# -- NoisyTwins (--noisy-twins, --noisy-twins-sigma) -----------------------------------------------------
def test_noisy_twins_is_passed_only_when_set(tmp_path, data, labels):
    cond = dict(data=str(data), preset="tiny", cond="group", labels=str(labels))
    args = TrainRequest(**cond, noisy_twins=0.02, noisy_twins_sigma=0.5).checked().cli_args(tmp_path / "t")
    assert args[args.index("--noisy-twins") + 1] == "0.02" and args[args.index("--noisy-twins-sigma") + 1] == "0.5"
    cfg, retune = child_config(TrainRequest(**cond, noisy_twins=0.02, noisy_twins_sigma=0.5), tmp_path / "t")
    assert (cfg.noisy_twins, cfg.noisy_twins_sigma, cfg.cond, retune) == (0.02, 0.5, "group", None)
    # a weight alone: the trainer's noise (0.25), no sigma on the command line
    args = TrainRequest(**cond, noisy_twins=0.01).checked().cli_args(tmp_path / "w")
    assert args[args.index("--noisy-twins") + 1] == "0.01" and "--noisy-twins-sigma" not in args
    assert child_config(TrainRequest(**cond, noisy_twins=0.01), tmp_path / "w")[0].noisy_twins_sigma == 0.25
    # every digit typed reaches the run (%g would round it to 6 and a plain resume would then see a difference)
    cfg, _ = child_config(TrainRequest(**cond, noisy_twins=0.0012345678), tmp_path / "p")
    assert cfg.noisy_twins == 0.0012345678
    # 0 and 0: the command as before, the trainer's defaults
    before = TrainRequest(**cond).checked().cli_args(tmp_path / "z")
    assert not {"--noisy-twins", "--noisy-twins-sigma"} & set(before)
    assert TrainRequest(**cond, noisy_twins=0.0, noisy_twins_sigma=0.0).checked().cli_args(tmp_path / "z") == before
    cfg, _ = child_config(TrainRequest(**cond), tmp_path / "z")
    assert (cfg.noisy_twins, cfg.noisy_twins_sigma) == (0.0, 0.25)
    # emoji64 with the preset's labels counts as conditional
    cfg, _ = child_config(TrainRequest(preset="emoji64", cond="class", noisy_twins=0.005), tmp_path / "e")
    assert cfg.noisy_twins == 0.005 and cfg.cond == "class"


@pytest.mark.parametrize("kw, msg", [
    (dict(noisy_twins=0.02), r"NoisyTwins \(weight 0.02\) .* this run is unconditional .* set NoisyTwins weight to 0"),
    (dict(noisy_twins=-0.01, cond="group"), r"NoisyTwins weight must be a number of 0 or more .*got -0.01"),
    (dict(noisy_twins=math.nan, cond="group"), r"NoisyTwins weight must be a number of 0 or more"),
    (dict(noisy_twins=math.inf, cond="group"), r"NoisyTwins weight must be a number of 0 or more .*got inf"),
    (dict(noisy_twins=-1.0), r"NoisyTwins weight must be a number"),        # the range first: one fix at a time
    (dict(noisy_twins=0.02, noisy_twins_sigma=-0.5, cond="group"), r"twins noise must be a number of 0 or more "
                                                                   r"\(0 = the trainer's 0.25.*got -0.5"),
    (dict(noisy_twins=0.02, noisy_twins_sigma=math.nan, cond="group"), r"twins noise must be a number of 0 or more"),
    (dict(noisy_twins=0.02, noisy_twins_sigma=math.inf, cond="group"), r"twins noise must be a number of 0 or more"),
    (dict(noisy_twins=0.02, cond="group", batch=2), r"NoisyTwins pairs up each batch .* at least 4; set Batch to 4 "
                                                    r"or more .*got 2"),
])
def test_bad_noisy_twins_is_refused_before_anything_starts(stand_in, data, labels, kw, msg):
    lab = {"labels": str(labels)} if kw.get("cond") else {}
    with pytest.raises(InputError, match=msg):
        stand_in.start(TrainRequest(**{"data": str(data), "preset": "tiny", "name": "bad", **lab, **kw}))
    assert stand_in.runs() == [] and not (stand_in.runs_dir / "bad").exists()


def test_a_resumed_run_takes_noisy_twins_only_with_retune_and_classes(stand_in):
    _saved_run(stand_in, "cond", cond="group", noisy_twins=0.0, noisy_twins_sigma=0.25)
    _saved_run(stand_in, "older", cond="group")                      # saved before the option: it trained without
    _saved_run(stand_in, "twins", cond="group", noisy_twins=0.02, noisy_twins_sigma=0.5)
    _saved_run(stand_in, "uncond", cond="")
    for name in ("cond", "older"):
        with pytest.raises(InputError, match=r"plain resume keeps the run's recipe, so NoisyTwins weight 0.01 "
                                             r"\(the run's: 0\), twins noise 0.75 \(the run's: 0.25\) would be "
                                             r"ignored; tick Retune"):
            stand_in.start(TrainRequest(preset="tiny", name=name, resume=True, noisy_twins=0.01,
                                        noisy_twins_sigma=0.75))
    with pytest.raises(InputError, match=r"so twins noise 0.75 \(the run's: 0.5\) would be ignored"):
        stand_in.start(TrainRequest(preset="tiny", name="twins", resume=True, noisy_twins=0.02, noisy_twins_sigma=0.75))
    for retune in (False, True):
        with pytest.raises(InputError, match=r"the run 'uncond' is unconditional .* set NoisyTwins weight to 0"):
            stand_in.start(TrainRequest(preset="tiny", name="uncond", resume=True, retune=retune, noisy_twins=0.02))
    assert not any((stand_in.runs_dir / n / "run.json").exists() for n in ("cond", "older", "twins", "uncond"))

    stand_in.start(TrainRequest(preset="tiny", name="cond", resume=True, retune=True, noisy_twins=0.01))
    argv = trainer_argv(stand_in.runs_dir / "cond")
    assert "--retune" in argv and argv[argv.index("--noisy-twins") + 1] == "0.01" and "--cond" not in argv
    assert "--noisy-twins-sigma" not in argv                         # 0: the run keeps its own noise
    settle(stand_in)
    # the run's own settings, or none: a plain resume as before
    stand_in.start(TrainRequest(preset="tiny", name="twins", resume=True, noisy_twins=0.02, noisy_twins_sigma=0.5))
    argv = trainer_argv(stand_in.runs_dir / "twins")
    assert "--retune" not in argv and argv[argv.index("--noisy-twins") + 1] == "0.02"
    settle(stand_in)
    stand_in.start(TrainRequest(preset="tiny", name="uncond", resume=True))
    assert "--noisy-twins" not in trainer_argv(stand_in.runs_dir / "uncond")


def test_train_tab_trains_and_exports_a_noisy_twins_run(tmp_path, data, labels, capsys):
    """The NoisyTwins weight and Twins noise under Classes (conditional): refused without a class key or below 0
    (the form is no output of Start, so it keeps what was typed), passed as --noisy-twins / --noisy-twins-sigma
    otherwise; the run it starts (here in this process, on the argv the manager wrote) trains with them, and
    Export to studio names them in the model's metadata."""
    import gradio as gr

    from ui.train_tab import TrainView

    m = TrainingRunManager(tmp_path / "runs", python=TRUE, device="cpu")
    try:
        demo, start = _tab(tmp_path, m)
        props = {c["props"].get("elem_id"): c["props"] for c in demo.get_config_file()["components"]}
        weight, sigma = props["train-noisy-twins"], props["train-noisy-twins-sigma"]
        assert (weight["label"], weight["value"], weight["minimum"]) == ("NoisyTwins weight", 0, 0)
        assert (sigma["label"], sigma["value"], sigma["minimum"]) == ("Twins noise", 0, 0)
        for words in ("NoisyTwins", "0 = off", "0.001-0.01", "class key"):
            assert words in weight["info"]
        assert "0 = the trainer's 0.25" in sigma["info"]
        # in the Classes accordion, with the class key and the class balance
        config = demo.get_config_file()
        ids = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
        accordion = next(i for i, e in ids.items() if e == "train-classes")
        inside = {ids[i] for i in _ids_under(config["layout"], accordion)}
        assert {"train-cond", "train-class-balance", "train-noisy-twins", "train-noisy-twins-sigma"} <= inside
        assert "train-init-g" not in inside                              # (the check sees the accordion only)

        view = TrainView()
        base = dict(data=str(data), preset="tiny", batch=8, kimg=0.016, log_every=1, view=view)
        with pytest.raises(gr.Error, match="this run is unconditional"):
            start.fn(**base, name="no-key", noisy_twins=0.02)
        with pytest.raises(gr.Error, match="NoisyTwins weight must be a number of 0 or more"):
            start.fn(**base, name="negative", cond="group", labels=str(labels), noisy_twins=-0.02)
        with pytest.raises(gr.Error, match="twins noise must be a number of 0 or more"):
            start.fn(**base, name="negative", cond="group", labels=str(labels), noisy_twins=0.02,
                     noisy_twins_sigma=-1)
        assert m.runs() == []

        start.fn(**base, name="twins", cond="group", labels=str(labels), noisy_twins=0.02, noisy_twins_sigma=0.5)
        settle(m)
        run = m.runs_dir / "twins"
        argv = trainer_argv(run)
        assert argv[argv.index("--noisy-twins") + 1] == "0.02" and argv[argv.index("--noisy-twins-sigma") + 1] == "0.5"
        assert argv[argv.index("--cond") + 1] == "group"
        req = json.loads((run / "run.json").read_text())["request"]
        assert (req["noisy_twins"], req["noisy_twins_sigma"]) == (0.02, 0.5)
        capsys.readouterr()
        assert cli.main(argv) == 0, capsys.readouterr().err             # the run the tab started
        assert "NoisyTwins on (weight 0.02, class-embedding noise 0.5)" in capsys.readouterr().out
        config = json.loads((run / "state.json").read_text())["config"]
        assert (config["noisy_twins"], config["noisy_twins_sigma"], config["cond"]) == (0.02, 0.5, "group")
        assert any("twins" in r for r in records(run, "train"))

        paths = m.export("twins", tmp_path / "models")                 # Export to studio
        meta = json.loads(paths["config"].read_text())["metadata"]["training"]
        assert meta["noisy_twins"] == {"weight": 0.02, "sigma": 0.5, "start_kimg": 0.0, "beta": 0.0}
        assert "NoisyTwins (`--noisy-twins 0.02`)" in paths["card"].read_text()

        # the noise without a weight does nothing in a new run: said, and passed as asked
        with pytest.warns(UserWarning, match="with a NoisyTwins weight of 0 it does nothing"):
            start.fn(**base, name="noise-only", noisy_twins_sigma=0.5)
        settle(m)
        # both left alone: the command as before
        start.fn(**base, name="plain", cond="group", labels=str(labels), noisy_twins=weight["value"],
                 noisy_twins_sigma=sigma["value"])
        assert not {"--noisy-twins", "--noisy-twins-sigma"} & set(trainer_argv(m.runs_dir / "plain"))
    finally:
        m.stop_all(wait=True, grace_s=5)


def _ids_under(node, target: int) -> list[int]:
    """The component ids inside the layout node of id `target` (Gradio's config: {"id", "children"})."""
    if isinstance(node, dict):
        if node.get("id") == target:
            found, stack = [], list(node.get("children") or [])
            while stack:
                n = stack.pop()
                found.append(n["id"])
                stack += n.get("children") or []
            return found
        node = node.get("children") or []
    for child in node:
        hit = _ids_under(child, target)
        if hit:
            return hit
    return []
