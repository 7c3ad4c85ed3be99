"""Training recipes: gradient accumulation (exact, counted in optimizer steps, resumable), parameter groups."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from hydra import compose, initialize_config_dir

from expkit.config.build import build_runner
from expkit.config.cli import CONF_DIR
from expkit.core.errors import ConfigError
from expkit.core.hydra_compat import INIT_KWARGS


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


def _train(work: Path, *overrides: str):
    runner = build_runner(_compose("trainer.max_epochs=2", *overrides), work)
    return runner, runner.run()


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize(("batch", "k", "clip"), [(32, 2, None), (32, 3, None), (32, 2, 0.5)])
def test_accumulation_equals_one_batch_of_the_windows_samples(tmp_path, batch, k, clip):
    """1,258 training samples: the last window of each epoch is shorter (42 of 64; 10 of 96), and
    each micro-batch weighs by its share of the window's samples, so even that window is exact."""
    extra = [f"trainer.clip_grad_norm={clip}"] if clip else []
    big, big_result = _train(tmp_path / "big", f"data.batch_size={batch * k}", *extra)
    acc, acc_result = _train(
        tmp_path / "acc", f"data.batch_size={batch}", f"trainer.accumulate_grad_batches={k}", *extra
    )
    assert acc_result["iter"] == big_result["iter"] == 2 * -(-1258 // (batch * k))  # iterations are optimizer steps
    assert _max_difference(big.model, acc.model) < 1e-5
    plain, _ = _train(tmp_path / "plain", f"data.batch_size={batch}")  # without accumulation: different weights
    assert _max_difference(big.model, plain.model) > 1e-3


def test_steps_drive_logs_schedulers_and_checkpoints(tmp_path):
    _, result = _train(
        tmp_path,
        "data.batch_size=16",
        "trainer.accumulate_grad_batches=4",
        "sched=cosine",
        "default_hooks.logger.interval=5",
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=7",
        "default_hooks.checkpoint.max_keep_ckpts=-1",  # (iter_7.pth is read below)
    )
    steps_per_epoch = math.ceil(math.ceil(1258 / 16) / 4)  # 79 batches -> 20 steps
    assert result["iter"] == 2 * steps_per_epoch
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train][:4] == [5, 10, 15, 20]  # the logger's interval counts steps
    assert train[-1]["train/lr"] < 0.01 * train[0]["train/lr"]  # the cosine ran its whole length in steps
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*.pth"))
    assert "iter_7.pth" in names and "iter_14.pth" in names
    meta = torch.load(tmp_path / "checkpoints" / "iter_7.pth", weights_only=True)["meta"]
    assert (meta["iter"], meta["inner_iter"]) == (7, 28)  # at a window boundary: 7 steps = 28 batches


def test_a_bad_accumulation_value_is_named():
    for value in ("0", "-2", "1.5"):
        with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches must be a positive integer"):
            build_runner(_compose(f"trainer.accumulate_grad_batches={value}"), "/nonexistent")


SLOW_HOOK = """
import time
from expkit import Hook

class Slow(Hook):
    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        time.sleep(0.03)
"""
ACCUMULATE = [
    "trainer.max_epochs=3",
    "data.batch_size=32",
    "trainer.accumulate_grad_batches=2",
    "default_hooks.checkpoint.by_epoch=false",
    "default_hooks.checkpoint.interval=7",
]


@pytest.mark.slow
def test_accumulation_killed_mid_epoch_resumes_bit_identical(tmp_path):
    """20 steps an epoch; iteration checkpoints every 7 steps land mid-epoch, at window boundaries."""
    reference = tmp_path / "reference"
    assert run_cli(f"hydra.run.dir={reference}", *ACCUMULATE).returncode == 0
    (tmp_path / "conf" / "hooks").mkdir(parents=True)
    (tmp_path / "conf" / "hooks" / "slow.yaml").write_text("slow:\n  _target_: slowhook.Slow\n")
    (tmp_path / "slowhook.py").write_text(SLOW_HOOK)
    work = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expkit.train",
            "--config-dir",
            str(tmp_path / "conf"),
            "hooks=[slow]",
            f"hydra.run.dir={work}",
            *ACCUMULATE,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pointer, deadline = work / "checkpoints" / "last_checkpoint", time.time() + 120
    try:
        while time.time() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            name = pointer.read_text() if pointer.exists() else ""
            if name.startswith("iter_") and 20 < int(name[5:-4]) < 40:  # mid-epoch 2
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    killed_at = torch.load(work / "checkpoints" / pointer.read_text(), weights_only=True)["meta"]
    assert killed_at["inner_iter"] == 2 * (killed_at["iter"] - 20)  # batches = 2 x steps into the epoch
    # (the run's own overrides hold hooks=[slow], from a --config-dir this resume leaves out: hooks=[] drops it)
    resumed = run_cli(f"hydra.run.dir={work}", "resume=true", "hooks=[]", *ACCUMULATE)
    assert resumed.returncode == 0, resumed.output
    final = torch.load(work / "checkpoints" / "iter_60.pth", weights_only=True)["state_dict"]
    expected = torch.load(reference / "checkpoints" / "iter_60.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(final[k], expected[k]) for k in expected)


# -- parameter groups ---------------------------------------------------------------------------
NO_DECAY = 'optim.param_groups=[{match:"*.bias",weight_decay:0.0},{match:norm,weight_decay:0.0}]'


def test_param_groups_put_biases_and_norm_parameters_in_zero_decay_groups(tmp_path):
    runner, _ = _train(tmp_path, "model=cnn", "optim=adamw", NO_DECAY, "trainer.max_epochs=1")
    names = {id(p): n for n, p in runner.model.named_parameters()}
    norms = {
        f"{m}.{p}"
        for m, mod in runner.model.named_modules()
        if isinstance(mod, torch.nn.BatchNorm2d)
        for p, _ in mod.named_parameters(recurse=False)
    }
    groups = {g["name"]: g for g in runner.optimizer.param_groups}
    assert list(groups) == ["default", "bias", "norm"]  # the rest first, then the rules in order
    zero = {names[id(p)] for name in ("bias", "norm") for p in groups[name]["params"]}
    assert zero == {n for n in names.values() if n.endswith(".bias")} | norms  # exactly biases and BatchNorm
    assert all(groups[name]["weight_decay"] == 0.0 for name in ("bias", "norm"))
    assert groups["default"]["weight_decay"] == 0.01 and len(groups["default"]["params"]) == 3
    saved = torch.load(tmp_path / "checkpoints" / "epoch_1.pth", weights_only=True)["optimizer"]["param_groups"]
    assert [(g["name"], g["weight_decay"], len(g["params"])) for g in saved] == [
        ("default", 0.01, 3),
        ("bias", 0.0, 3),
        ("norm", 0.0, 2),
    ]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"train/lr/default", "train/lr/bias", "train/lr/norm"} <= set(next(r for r in records if "train/lr" in r))

    resumed = build_runner(
        _compose("model=cnn", "optim=adamw", NO_DECAY, "trainer.max_epochs=2", "resume=true"), tmp_path
    )
    assert resumed.run()["epoch"] == 2 and resumed.optimizer.param_groups[1]["weight_decay"] == 0.0


def test_the_first_matching_rule_wins_and_multipliers_scale_the_optimizers_values(tmp_path):
    rules = 'optim.param_groups=[{match:"*.bias",lr_mult:2},{match:"head.*",lr_mult:10,decay_mult:0,name:head}]'
    runner = build_runner(_compose("model=cnn", "optim=adamw", "optim.lr=0.01", rules), tmp_path)
    groups = {g["name"]: g for g in runner.optimizer.param_groups}
    names = {id(p): n for n, p in runner.model.named_parameters()}
    assert [names[id(p)] for p in groups["head"]["params"]] == ["head.2.weight"]  # head.2.bias went to *.bias
    assert groups["head"]["lr"] == pytest.approx(0.1) and groups["head"]["weight_decay"] == 0.0
    assert groups["bias"]["lr"] == pytest.approx(0.02) and groups["default"]["lr"] == pytest.approx(0.01)


def test_bad_param_group_rules_are_named(tmp_path, caplog):
    with pytest.raises(
        ConfigError, match=r"optim.param_groups\[0\]: 'wieght_decay' is not an argument of the optimizer"
    ):
        build_runner(_compose("optim=adamw", 'optim.param_groups=[{match:"*.bias",wieght_decay:0}]'), tmp_path)
    with pytest.raises(ConfigError, match=r"optim.param_groups\[0\]: a rule needs match"):
        build_runner(_compose("optim.param_groups=[{weight_decay:0}]"), tmp_path)
    build_runner(_compose('optim.param_groups=[{match:"encoder.*",weight_decay:0}]'), tmp_path)
    assert "optim.param_groups[0] (match: encoder.*) matches no parameter" in caplog.text


# -- several validation sets ----------------------------------------------------------------------
def test_named_validation_sets_are_reported_monitored_and_checked(tmp_path):
    noisy = [
        "data.noisy_val=0.5",
        "trainer.max_epochs=3",
        "monitor=val/clean/acc",
        "hooks=[early_stopping]",
        "hooks.early_stopping.monitor=val/noisy/loss",
    ]
    _, result = _train(tmp_path, *noisy)
    validations = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val/clean/acc" in line
    ]
    assert len(validations) == 3
    assert {"val/clean/loss", "val/clean/acc", "val/noisy/loss", "val/noisy/acc"} <= set(validations[-1])
    assert all(v["val/noisy/acc"] < v["val/clean/acc"] for v in validations)  # the noisy copy is harder
    best = result["best_metrics"]
    assert (best["val/clean/acc"]["rule"], best["val/noisy/loss"]["rule"]) == ("greater", "less")
    assert result["best_checkpoint"].endswith(f"best_val_clean_acc_epoch_{best['val/clean/acc']['epoch']}.pth")
    with pytest.raises(
        ConfigError, match=r"'val/acc' is not a metric .* val/clean/loss, val/clean/acc, val/noisy/loss"
    ):
        _train(tmp_path / "b", "data.noisy_val=0.5")  # monitor=val/acc: validation reports per set


def test_each_named_set_is_sharded_under_ddp(monkeypatch):
    from expkit.core import distributed
    from expkit.data import DigitsData, ShardSampler

    monkeypatch.setattr(distributed, "rank_and_world", lambda: (1, 2))
    _, val, _ = DigitsData(noisy_val=0.3).loaders()
    assert set(val) == {"clean", "noisy"}
    for loader in val.values():
        assert isinstance(loader.sampler, ShardSampler) and loader.sampler.indices[:3] == [1, 3, 5]


# -- several optimizers: a model that owns its update ------------------------------------------------
def test_a_gan_with_two_optimizers_checkpoints_both_and_resumes_bit_identical(tmp_path):
    straight, result = _train(tmp_path / "straight", "experiment=gan", "trainer.max_epochs=2", "sched=cosine")
    assert result["status"] == "completed" and result["monitor_rule"] == "less"
    checkpoint = torch.load(tmp_path / "straight" / "checkpoints" / "epoch_2.pth", weights_only=True)
    assert set(checkpoint["optimizers"]) == {"generator", "discriminator"} and "optimizer" not in checkpoint
    for name in ("generator", "discriminator"):  # each optimizer updates its own submodule, and has its own state
        params = checkpoint["optimizers"][name]["param_groups"][0]["params"]
        assert len(params) == len(list(getattr(straight.model, name).parameters()))
        assert len(checkpoint["optimizers"][name]["state"]) == len(params)
    assert set(checkpoint["schedulers"]) == {"generator", "discriminator"}  # one scheduler per optimizer
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in records if "train/d_loss" in r)  # the model's own scalars (outputs["log"])
    assert {"train/g_loss", "train/lr/generator", "train/lr/discriminator"} <= set(logged)

    _, first = _train(
        tmp_path / "resumed", "experiment=gan", "sched=cosine", "hooks=[stop_after]", "hooks.stop_after.epochs=1"
    )  # the same run (its cosine spans 2 epochs), stopped after one
    assert (first["status"], first["epoch"]) == ("stopped", 1)
    resumed, _ = _train(tmp_path / "resumed", "experiment=gan", "sched=cosine", "resume=true")
    for key, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    for name in ("generator", "discriminator"):
        assert resumed.optimizers[name].param_groups[0]["lr"] == straight.optimizers[name].param_groups[0]["lr"]


def test_several_optimizers_need_a_model_that_owns_its_update(tmp_path):
    with pytest.raises(
        ConfigError, match=r"optim defines 2 optimizers \(generator, discriminator\): the model must own"
    ):
        build_runner(
            _compose("optim=gan", "model=mlp", "optim.generator.module=null", "optim.discriminator.module=null"),
            tmp_path,
        )
    with pytest.raises(ConfigError, match=r"optim.generator.module=gen: the model has no submodule 'gen'"):
        build_runner(_compose("experiment=gan", "optim.generator.module=gen"), tmp_path)


# -- momentum encoders (self-supervised learning) ----------------------------------------------------
def test_the_momentum_encoder_follows_the_online_network_on_its_schedule(tmp_path):
    from conftest import Twin, toy_runner

    from expkit.hooks import MomentumEncoderHook

    cosine = MomentumEncoderHook(momentum=0.9, schedule="cosine", end_momentum=1.0)
    assert (cosine.momentum_at(0, 10), cosine.momentum_at(5, 10), cosine.momentum_at(10, 10)) == pytest.approx(
        (0.9, 0.95, 1.0)
    )
    assert MomentumEncoderHook(momentum=0.9, schedule="constant").momentum_at(7, 10) == 0.9

    follow = Twin()
    toy_runner(tmp_path / "m0", model=follow, hooks=[MomentumEncoderHook(momentum=0.0, schedule="constant")]).run()
    for t, o in zip(follow.target.parameters(), follow.online.parameters()):  # m = 0: the target is the online net
        assert torch.equal(t, o) and not t.requires_grad

    frozen = Twin()
    start = [p.clone() for p in frozen.online.parameters()]
    hook = MomentumEncoderHook(momentum=1.0, end_momentum=1.0)
    toy_runner(tmp_path / "m1", model=frozen, hooks=[hook]).run()  # m = 1: the target keeps its initial copy
    assert all(torch.equal(t, s) for t, s in zip(frozen.target.parameters(), start))
    assert not all(torch.equal(o, s) for o, s in zip(frozen.online.parameters(), start))  # while online trained


def test_byol_learns_a_representation_a_linear_probe_reads_better_than_random_init(tmp_path):
    _, result = _train(tmp_path, "experiment=byol_digits", "trainer.max_epochs=15")
    probe = result["linear_probe"]
    assert probe["acc"] > probe["random_init_acc"] + 0.05, probe  # measured: 0.88 vs 0.73 after 30 epochs
    checkpoint = torch.load(tmp_path / "checkpoints" / "epoch_15.pth", weights_only=True)
    assert any(k.startswith("target.") for k in checkpoint["state_dict"])  # the target network is checkpointed
    assert 0.99 < checkpoint["hooks"]["momentum_encoder"]["momentum"] <= 1.0  # near the end of BYOL's cosine


def test_byol_resumed_after_one_epoch_is_bit_identical(tmp_path):
    straight, _ = _train(tmp_path / "straight", "experiment=byol_digits", "hooks=[momentum_encoder]")
    _train(
        tmp_path / "resumed",
        "experiment=byol_digits",
        "hooks=[momentum_encoder,stop_after]",
        "hooks.stop_after.epochs=1",
    )
    resumed, _ = _train(tmp_path / "resumed", "experiment=byol_digits", "hooks=[momentum_encoder]", "resume=true")
    for key, value in straight.model.state_dict().items():  # the target network included
        assert torch.equal(value, resumed.model.state_dict()[key]), key
