"""Crash-consistent records: after a crash and a resume, the logs read as one uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli, small_disk
from hydra import compose, initialize_config_dir

from expkit import Hook
from expkit.config.build import build_runner
from expkit.config.cli import CONF_DIR
from expkit.core.hydra_compat import INIT_KWARGS

TIMING = ("train/time", "train/data_time")
COMMON = ["trainer.max_epochs=3", "default_hooks.logger.interval=5", "logger=[tensorboard]"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


def _records(work: Path) -> list[dict]:
    lines = (work / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def _tensorboard(work: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if tag.startswith(("train/loss", "val/"))
    }


class CrashAt(Hook):
    """Dies after iteration `at` has been logged (the last checkpoint is older): a crash."""

    def __init__(self, at: int, stage: str = "train") -> None:
        self.at, self.stage = at, stage

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if self.stage == "train" and runner.iter + 1 == self.at:
            raise RuntimeError("crash")

    def before_test(self, runner):
        if self.stage == "test":
            raise RuntimeError("crash in the test")


@pytest.mark.parametrize("crash", [("train", 55), ("train", 80), ("test", 0)], ids=["mid-epoch", "epoch-end", "test"])
def test_a_resumed_run_logs_what_an_uninterrupted_run_logs(tmp_path, crash):
    stage, at = crash
    reference = build_runner(_compose(*COMMON), tmp_path / "reference").run()
    work = tmp_path / "run"
    crashed = build_runner(_compose(*COMMON), work)
    crashed.register_hook(CrashAt(at, stage))
    with pytest.raises(Exception, match="crash"):
        crashed.run()
    resumed = build_runner(_compose(*COMMON, "resume=true"), work).run()
    assert _records(work) == _records(tmp_path / "reference")  # no duplicate or out-of-order step
    assert _tensorboard(work) == _tensorboard(tmp_path / "reference")
    for key in ("status", "epoch", "iter", "final_metrics", "best_metrics"):
        assert resumed[key] == reference[key], key  # the last validation's metrics come back with the state
    assert not list(work.rglob("*.tmp*"))


def _wandb(work: Path) -> list[dict]:
    from expkit.loggers.wandb_files import wandb_history

    return [
        {k: v for k, v in row.items() if k not in TIMING and k not in ("_runtime", "_timestamp")}
        for row in wandb_history(work)
    ]


def test_a_resumed_run_continues_its_wandb_run_with_the_history_of_an_uninterrupted_run(tmp_path, monkeypatch):
    from expkit.loggers.wandb_files import offline_run_files, read_wandb_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: offline
    overrides = ["trainer.max_epochs=2", "default_hooks.logger.interval=5", "logger=[wandb]"]
    build_runner(_compose(*overrides), tmp_path / "reference").run()
    work = tmp_path / "run"
    crashed = build_runner(_compose(*overrides), work)
    crashed.register_hook(CrashAt(55))  # after the epoch-1 checkpoint (step 40): steps 45-55 are void
    with pytest.raises(Exception, match="crash"):
        crashed.run()
    build_runner(_compose(*overrides, "resume=true"), work).run()
    attempts = [read_wandb_run(p) for p in offline_run_files(work)]
    assert len(attempts) == 2 and len({a["run"]["id"] for a in attempts}) == 1  # one wandb run, resumed
    assert sorted(r["_step"] for a in attempts for r in a["history"]).count(50) == 2  # the void step was logged twice
    history = _wandb(work)
    assert [r["_step"] for r in history] == sorted(r["_step"] for r in history)
    assert history == _wandb(tmp_path / "reference")
    assert {a["summary"]["status"] for a in attempts} == {"failed", "completed"}


EXIT_HOOK = """
import os
from expkit import Hook

class ExitAt(Hook):
    '''Ends the process at once, as SIGKILL would (no cleanup, no flush), at a chosen point.'''

    def __init__(self, point: str) -> None:
        self.point, self.saves = point, 0

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if self.point == "mid-epoch" and runner.iter + 1 == 55:
            os._exit(9)

    def after_val_iter(self, runner, *, batch_idx, data_batch, outputs):
        if self.point == "validation" and runner.epoch == 2 and batch_idx == 3:
            os._exit(9)

    def before_save_checkpoint(self, runner, *, checkpoint):
        self.saves += "optimizer" in checkpoint  # regular checkpoints (best ones carry no optimizer)
        if self.point == "checkpoint-write" and self.saves == 2 and "optimizer" in checkpoint:
            (runner.work_dir / "checkpoints" / f".epoch_2.pth.tmp{os.getpid()}").write_bytes(b"half written")
            os._exit(9)

    def after_save_checkpoint(self, runner, *, path, is_best, metric):
        if self.point == "after-last-checkpoint" and path.name == "epoch_3.pth":
            os._exit(9)
"""


@pytest.fixture(scope="module")
def reference_cli(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli(f"hydra.run.dir={work}", *COMMON)
    assert proc.returncode == 0, proc.output
    return work


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid-epoch", "validation", "checkpoint-write", "after-last-checkpoint"])
def test_killed_anywhere_then_resumed_records_equal_an_uninterrupted_run(tmp_path, point, reference_cli):
    (tmp_path / "exithook.py").write_text(EXIT_HOOK)
    work = tmp_path / "run"
    killed = run_cli(
        f"hydra.run.dir={work}",
        *COMMON,
        "+hooks.exit._target_=exithook.ExitAt",
        f"+hooks.exit.point={point}",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert killed.returncode == 9, killed.output
    # (the run's own overrides hold the exit hook: the resume drops it)
    resumed = run_cli(f"hydra.run.dir={work}", *COMMON, "resume=true", "~hooks.exit")
    assert resumed.returncode == 0, resumed.output
    assert _records(work) == _records(reference_cli)
    assert _tensorboard(work) == _tensorboard(reference_cli)
    result, reference = (json.loads((w / "result.json").read_text()) for w in (work, reference_cli))
    for key in ("status", "epoch", "iter", "final_metrics", "best_metrics", "monitor_rule"):
        assert result[key] == reference[key], key
    final, expected = (
        torch.load(w / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"] for w in (work, reference_cli)
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert not list(work.rglob("*.tmp*"))  # the killed writer's temporary file is gone


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])  # true: the write fails in the background thread
def test_a_full_disk_fails_naming_the_file_and_resumes_bit_identical_with_space(tmp_path, reference_cli, async_save):
    with small_disk(tmp_path / "disk", "2m") as disk:
        work = disk / "run"
        full = run_cli(f"hydra.run.dir={work}", *COMMON, f"default_hooks.checkpoint.async_save={async_save}")
        # (~0.7 MB a regular checkpoint: the disk fills in epoch 2)
        assert full.returncode == 1, full.output
        assert "could not write" in full.stderr and "no space left on the device" in full.stderr
        assert "is intact" in full.stderr and "Traceback" not in full.stderr
        result = json.loads((work / "result.json").read_text())
        assert result["status"] == "failed" and "no space left" in result["error"]
        for path in (work / "checkpoints").glob("*.pth"):
            torch.load(path, weights_only=True)  # every earlier checkpoint is complete
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert not (work / "checkpoints" / "epoch_3.pth").exists()
        resumed = run_cli(f"hydra.run.dir={work}", *COMMON, "resume=true")
        assert resumed.returncode == 0, resumed.output
        final, expected = (
            torch.load(w / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
            for w in (work, reference_cli)
        )
        assert all(torch.equal(final[k], expected[k]) for k in expected)


FILL_HOOK = """
from expkit import Hook

class Fill(Hook):
    '''Another process fills the disk after iteration `at`.'''

    def __init__(self, at: int) -> None:
        self.at = at

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if runner.iter + 1 == self.at:
            try:
                with open(runner.work_dir.parent / "filler", "wb", buffering=0) as f:
                    while True:
                        f.write(bytes(4096))
            except OSError:
                pass
"""


@pytest.mark.slow
def test_a_disk_filled_while_logging_fails_naming_metrics_jsonl_and_resumes(tmp_path, reference_cli):
    (tmp_path / "fillhook.py").write_text(FILL_HOOK)
    with small_disk(tmp_path / "disk", "16m") as disk:
        work = disk / "run"
        args = [f"hydra.run.dir={work}", *COMMON, "default_hooks.logger.interval=1"]  # a record per step
        full = run_cli(
            *args, "+hooks.fill._target_=fillhook.Fill", "+hooks.fill.at=81", env={"PYTHONPATH": str(tmp_path)}
        )
        assert full.returncode == 1, full.output
        assert "could not append to " + str(work / "metrics.jsonl") in full.stderr, full.stderr
        assert "Traceback" not in full.stderr and "Logging error" not in full.stderr
        result = json.loads((work / "result.json").read_text())  # written although the disk is full
        assert result["status"] == "failed" and "metrics.jsonl" in result["error"]
        assert json.loads((work / "provenance.json").read_text())["status"] == "failed"
        assert torch.load(work / "checkpoints" / "epoch_2.pth", weights_only=True)["meta"]["iter"] == 80
        (disk / "filler").unlink()
        resumed = run_cli(*args, "resume=true", "~hooks.fill")  # (the run's own overrides hold the filling hook)
        assert resumed.returncode == 0, resumed.output
        steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(steps)  # no record twice, none out of order
        assert len([s for s in steps if s == 97]) == 1
        final, expected = (
            torch.load(w / "checkpoints" / "epoch_3.pth", weights_only=True)["state_dict"]
            for w in (work, reference_cli)
        )
        assert all(torch.equal(final[k], expected[k]) for k in expected)
        assert not list(work.rglob("*.tmp*")) and not (work / ".result.reserve").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["optim.lr=nan"], "optim.lr=nan is not a finite number"),
        (["optim.lr=inf"], "optim.lr=inf is not a finite number"),
        (["model.hidden=[0]"], "layer widths must be positive integers"),
        (["metrics.acc.top_k=20"], "metrics.acc (Accuracy) fails on the first validation batch"),
        (["hydra.run.dir=/proc/expkit-test/run"], "hydra.run.dir=/proc/expkit-test/run: cannot create or write"),
        (["x" * 5000 + "=1"], "5000-character key is not a key of the config"),
        (["nokey=1"], "nokey is not a key of the config"),  # Hydra's own errors exit 2 too, in one line
        (["optim.lr=[1"], "optim.lr=[1"),
        (["monitor=val/accc"], "monitor='val/accc' is not a metric that validation reports"),  # (not save_best=)
    ],
    ids=["nan", "inf", "zero-width", "top_k", "unwritable", "long-key", "unknown-key", "unparsable", "monitor"],
)
def test_bad_input_exits_2_with_one_message_naming_it(tmp_path, args, named):
    run_dir = [] if any(a.startswith("hydra.run.dir=") for a in args) else [f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_cli(*run_dir, *args, "trainer.max_epochs=1")
    assert proc.returncode == 2, proc.output
    assert named in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training


@pytest.mark.slow
@pytest.mark.long(seconds=53)
def test_the_fault_campaign_script_runs_and_finds_every_trial_consistent():
    proc = subprocess.run(
        [sys.executable, "benchmarks/fault_campaign.py", "--quick", "--seed", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "2 of 2 trials ended bit-identical with consistent records" in proc.stdout
