"""Crash-consistent records: after a crash and a resume, the logs read as one uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from expkit import Hook
from expkit.build import build_runner
from expkit.train import CONF_DIR

TIMING = ("train/time", "train/data_time")
COMMON = ["trainer.max_epochs=3", "default_hooks.logger.interval=5", "logger=[tensorboard]"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def _records(work: Path) -> list[dict]:
    lines = (work / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def _tensorboard(work: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if tag.startswith(("train/loss", "val/"))}  # fmt: skip


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
