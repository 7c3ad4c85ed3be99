"""The same command run again into a dir that holds a run or sweep jobs, without resume=true:
refused before anything is written there."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


def test_a_run_dir_that_holds_a_run_is_not_trained_over(tmp_path):
    run = tmp_path / "run"
    assert run_cli(f"hydra.run.dir={run}", "trainer.max_epochs=1").returncode == 0
    before = _snapshot(run)
    again = run_cli(f"hydra.run.dir={run}", "trainer.max_epochs=1")
    assert again.returncode == 2, again.output
    assert f"hydra.run.dir={run} already holds a completed run" in again.stderr
    assert "resume=true" in again.stderr and "Traceback" not in again.output
    assert _snapshot(run) == before  # nothing changed, not even .hydra/
    assert run_cli(f"hydra.run.dir={run}", "trainer.max_epochs=2", "resume=true").returncode == 0


def test_a_sweep_dir_that_holds_jobs_is_not_swept_over(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "optim.lr=0.1,0.05", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"]
    assert run_cli(*args).returncode == 0
    before = _snapshot(sweep)
    again = run_cli(*args)
    assert again.returncode == 2, again.output
    assert "already holds sweep jobs: 2 completed, 0 interrupted, 0 failed" in again.stderr
    assert "hydra.sweep.dir" in again.stderr and "resume=true" in again.stderr
    assert _snapshot(sweep) == before
    search = run_cli(
        "hparams_search=optuna", "hydra.sweeper.n_trials=1", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"
    )
    assert search.returncode == 2 and _snapshot(sweep) == before
    assert run_cli(*args, "resume=true").returncode == 0
