"""Records after a resume equal an uninterrupted run's, for every checkpoint schedule.

A run is killed (os._exit, as SIGKILL: no cleanup) right after its first validation record is
written, then resumed; metrics.jsonl must then hold exactly the records of the same run
never interrupted (timings aside): no validation twice, none lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow

EXIT_AFTER_VALIDATION = """
import os
from expkit import Hook
from expkit.core.stages import Priority

class ExitAfterValidation(Hook):
    '''Ends the process at the first validation, once every other hook has handled its metrics.'''
    priority = Priority.LOWEST

    def after_val_epoch(self, runner, *, metrics):
        os._exit(9)
"""

TRAINING = {  # 40 iterations an epoch (digits, the default batch size)
    "epochs": ["trainer.max_epochs=2"],
    "iterations": ["trainer.max_iters=60", "trainer.val_interval=20"],
}
SCHEDULES = {
    "every epoch": [],
    "every 5 iterations (one ends the epoch)": [
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=5",
    ],
    "every 8 iterations": ["default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=8"],
    "every 7 iterations": ["default_hooks.checkpoint.by_epoch=false", "default_hooks.checkpoint.interval=7"],
}


def _records(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("time")} for r in records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, list[dict]]:
    records = {}
    for name, training in TRAINING.items():
        run = tmp_path_factory.mktemp("reference") / name
        proc = run_cli(f"hydra.run.dir={run}", *training)
        assert proc.returncode == 0, proc.output
        records[name] = _records(run)
    return records


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("training", list(TRAINING))
def test_a_kill_after_a_validation_then_resume_records_each_validation_once(
    tmp_path, uninterrupted, training, schedule
):
    (tmp_path / "exitafterval.py").write_text(EXIT_AFTER_VALIDATION)
    run = tmp_path / "run"
    common = [f"hydra.run.dir={run}", *TRAINING[training], *SCHEDULES[schedule]]
    env = {"PYTHONPATH": str(tmp_path)}
    killed = run_cli(*common, "+hooks.exit._target_=exitafterval.ExitAfterValidation", env=env)
    assert killed.returncode == 9, killed.output
    resumed = run_cli(*common, "resume=true", "~hooks.exit")  # (the run's own overrides hold the exit hook)
    assert resumed.returncode == 0, resumed.output
    records = _records(run)
    val_steps = [r["step"] for r in records if any(k.startswith("val/") for k in r)]
    assert len(val_steps) == len(set(val_steps)), f"a validation recorded twice: {val_steps}"
    assert records == uninterrupted[training]
