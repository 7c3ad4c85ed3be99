"""The config tree: composes with every option, builds real objects, every key documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from expkit.config.build import build_runner
from expkit.config.cli import CONF_DIR, check_group_choices
from expkit.core.hydra_compat import INIT_KWARGS
from expkit.hooks import EMAHook

FAST = ["trainer.max_epochs=null", "trainer.max_iters=2", "trainer.val_interval=2", "trainer.device=cpu"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


def test_default_config_has_the_documented_keys():
    cfg = _compose()
    assert cfg.hooks == {}
    assert cfg.trainer.max_epochs == 20 and cfg.trainer.max_iters is None
    assert cfg.data._target_ == "expkit.data.DigitsData" and cfg.model._target_ == "expkit.models.MLP"
    assert list(cfg.default_hooks) == [
        "runtime_info",
        "timer",
        "sampler_seed",
        "logger",
        "param_scheduler",
        "checkpoint",
    ]
    for key in (
        "interval",
        "by_epoch",
        "save_optimizer",
        "save_param_scheduler",
        "out_dir",
        "max_keep_ckpts",
        "save_last",
        "save_best",
        "rule",
        "greater_keys",
        "less_keys",
        "save_begin",
        "filename_tmpl",
    ):
        assert key in cfg.default_hooks.checkpoint, key
    assert cfg.default_hooks.checkpoint.save_best == cfg.monitor == "val/acc"


def test_hooks_multiselect_recipe():
    assert list(_compose("hooks=[ema]").hooks) == ["ema"]
    assert _compose("hooks=[]").hooks == {}
    assert _compose("hooks=[ema]", "hooks.ema.momentum=0.001").hooks.ema.momentum == 0.001
    cfg = _compose("~default_hooks.checkpoint")
    assert "checkpoint" not in cfg.default_hooks


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet18"])
@pytest.mark.parametrize("optim", ["sgd", "adam", "adamw"])
def test_every_model_and_optimizer_builds_and_trains(tmp_path, model, optim):
    cfg = _compose(f"model={model}", f"optim={optim}", *FAST)
    runner = build_runner(cfg, tmp_path)
    result = runner.run()
    assert result["status"] == "completed" and runner.iter == 2
    assert type(runner.optimizer).__name__.lower() == optim


@pytest.mark.parametrize("sched", ["none", "step", "cosine", "warmup_cosine", "plateau"])
def test_every_scheduler_builds_and_steps(tmp_path, sched):
    cfg = _compose(f"sched={sched}", "trainer.max_epochs=2")
    runner = build_runner(cfg, tmp_path)
    lr0 = runner.optimizer.param_groups[0]["lr"]
    runner.run()
    lr1 = runner.optimizer.param_groups[0]["lr"]
    if sched in ("none", "step", "plateau"):  # step decays after 10 epochs; plateau after 3 bad ones
        assert lr1 == lr0 == 0.1
    else:
        assert lr1 < lr0


def test_cosine_reaches_its_floor_at_the_end_of_the_run(tmp_path):
    cfg = _compose("sched=cosine", "sched.scheduler.min_lr_ratio=0.1", "trainer.max_epochs=2")
    runner = build_runner(cfg, tmp_path)
    runner.run()
    assert runner.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1)


def test_experiment_and_debug_files(tmp_path):
    cfg = _compose("experiment=digits_cnn")
    assert cfg.model._target_ == "expkit.models.CNN" and cfg.optim._target_ == "torch.optim.AdamW"
    assert list(cfg.hooks) == ["ema"] and cfg.optim.lr == 0.003
    cfg = _compose("debug=fast")
    assert cfg.trainer.max_iters == 20 and cfg.trainer.device == "cpu"


def test_ema_from_its_yaml_is_a_real_hook(tmp_path):
    cfg = _compose("hooks=[ema]", "+hooks.ema.priority=ABOVE_NORMAL", *FAST)
    runner = build_runner(cfg, tmp_path)
    (ema,) = [h for h in runner.hooks if isinstance(h, EMAHook)]
    assert ema.priority == 40 and ema.momentum == 0.01


def test_fake_data_builds_with_torchvision(tmp_path):
    cfg = _compose("data=fake", "data.train_size=8", "data.val_size=4", "data.image_size=16", "model=cnn", *FAST)
    runner = build_runner(cfg, tmp_path)
    x, _ = next(iter(runner.train_loader))
    assert tuple(x.shape) == (8, 3, 16, 16) or tuple(x.shape[1:]) == (3, 16, 16)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["hooks=[ema,nope]"], "Unknown hook 'nope'"),
        (["-m", "hooks=[ema],[nope]"], "Unknown hook 'nope'"),
        (["-m", "model=mlp,nope"], "Unknown model option 'nope'"),
        (["optim=sgdd"], "Available optim: adam, adamw, gan, sgd"),
    ],
)
def test_group_choices_are_checked_with_the_options_listed(argv, fragment):
    assert fragment in check_group_choices(argv)


@pytest.mark.parametrize(
    "argv", [["hooks=[ema]"], ["model=cnn", "optim.lr=0.1"], ["~default_hooks.logger"], ["hooks=[]"]]
)
def test_valid_choices_pass(argv):
    assert check_group_choices(argv) is None


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["logger=[tensorbord]"], "did you mean logger=[tensorboard]?"),
        (["logger=tensorbord"], "did you mean logger=tensorboard?"),
        (["hooks=[ema,profilr]"], "did you mean hooks=[ema,profiler]?"),
        (["-m", "model=mlp,resnt"], "did you mean model=mlp,resnet18?"),
    ],
)
def test_the_suggestion_keeps_the_form_typed(argv, suggestion):
    assert suggestion in check_group_choices(argv)


def test_user_config_dir_adds_options(tmp_path):
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "mine.yaml").write_text("mine:\n  _target_: x.Y\n")
    assert check_group_choices(["--config-dir", str(tmp_path), "hooks=[ema,mine]"]) is None
    assert "mine" in check_group_choices(["--config-dir", str(tmp_path), "hooks=[oops]"])


KEY_LINE = re.compile(r"^\s*[A-Za-z_][\w]*:\s*\S")  # a key with a value on the same line


def test_every_yaml_key_with_a_value_has_a_comment():
    """STYLE: most YAML keys carry a comment (unit, valid values, or why)."""
    missing = []
    for path in sorted(Path(CONF_DIR).rglob("*.yaml")):
        in_block = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("template:"):
                in_block = True  # hydra's help template is text, not keys
            if in_block or line.strip().startswith(("#", "- ", "_target_", "_partial_", "defaults:")):
                continue
            if KEY_LINE.match(line) and "#" not in line and not line.strip().endswith(":"):
                missing.append(f"{path.relative_to(CONF_DIR)}:{number}: {line.strip()}")
    hydra_settings = ("dir:", "subdir:", "format:", "datefmt:", "app_name:")  # Hydra's own keys, self-explanatory
    undocumented = [m for m in missing if not m.split(": ", 1)[1].startswith(hydra_settings)]
    assert not undocumented, "\n".join(undocumented)


def test_compose_output_is_plain_yaml():
    assert "EMAHook" in OmegaConf.to_yaml(_compose("hooks=[ema]"))


def test_every_trainer_setting_has_one_default_in_code_and_yaml():
    """TrainerSettings (the Python API) and conf/trainer/default.yaml (the CLI) give the same
    default for every field, and neither has a key the other lacks."""
    import dataclasses

    from expkit.core.settings import TrainerSettings

    yaml = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "trainer" / "default.yaml"))
    code = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(TrainerSettings)
    }
    assert set(yaml) == set(code), set(yaml) ^ set(code)
    differ = {k: (code[k], yaml[k]) for k in code if str(code[k]) != str(yaml[k])}  # ("32" and 32 alike)
    assert not differ, differ


def test_the_default_hooks_in_code_are_the_yaml_ones():
    """expkit.default_hooks() builds what conf/default_hooks/default.yaml builds, hook by hook
    and argument by argument. One difference by design: the YAML's checkpoint.save_best is
    ${monitor} (the CLI's monitor, val/acc); the Python API has no monitor and saves no best
    checkpoint unless asked, as MMEngine's CheckpointHook."""
    import inspect

    from expkit import default_hooks
    from expkit.core.hydra_compat import instantiate  # (Hydra 1.4 warns about a bare instantiate)

    cfg = _compose()
    code = default_hooks()
    assert list(code) == list(cfg.default_hooks)
    for name, hook in code.items():
        node = OmegaConf.to_container(cfg.default_hooks[name], resolve=True)
        assert node.pop("_target_") == f"expkit.hooks.{type(hook).__name__}", name
        params = inspect.signature(type(hook).__init__).parameters
        assert set(node) <= set(params), f"{name}: the YAML sets {set(node) - set(params)}, not arguments"
        missing = {p for p in params if p not in ("self", "args", "kwargs") and p not in node}
        assert not missing, f"default_hooks.{name}: arguments the YAML does not list: {missing}"
        for key, value in node.items():
            default = params[key].default
            if (name, key) == ("checkpoint", "save_best"):
                assert default is None and value == cfg.monitor
                continue
            same = value == default or (value in ({}, []) and default is None)  # (an empty mapping: none)
            same = same or (value is not None and default is not None and type(default)(value) == default)
            assert same, f"default_hooks.{name}.{key}: {value!r} in the YAML, {default!r} in the code"
        assert type(instantiate(cfg.default_hooks[name])) is type(hook)


GROUP_LINE = re.compile(r"^\s*-\s*(\w+):\s*\S+\s*#\s*(.*)$")


@pytest.mark.parametrize("primary", ["train.yaml"])
def test_the_options_a_defaults_comment_lists_are_the_groups_options(primary):
    """`- data: digits  # digits | fake | ...`: every option named exists, and every option of
    the group is named (a comment that lists options lists all of them)."""
    wrong = []
    for line in (Path(CONF_DIR) / primary).read_text().splitlines():
        match = GROUP_LINE.match(line)
        if not match or "|" not in match.group(2):
            continue
        group, comment = match.groups()
        listed = {word.strip().split()[0] for word in comment.split("|") if word.strip()}
        present = {p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")}
        if listed != present:
            wrong.append(
                f"{group}: the comment lists {sorted(listed - present)} that do not exist and "
                f"misses {sorted(present - listed)}"
            )
    assert not wrong, "\n".join(wrong)
