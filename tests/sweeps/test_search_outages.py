"""A search's storage goes away under it: a real PostgreSQL server stopped as a crash stops it
(``pg_ctl -m immediate``) while real workers train. An outage shorter than
``hydra.sweeper.storage_wait_s`` loses nothing; a longer one stops the worker with exit 1 and
one line, its job ``stopped``, and ``resume=true`` finishes that trial from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from conftest import REPO, finish_workers, kill_workers, search_worker
from optuna.trial import TrialState

from expkit.sweeps.search import open_storage

pytestmark = pytest.mark.slow


def _search(storage: str, sweep: Path, *extra: str) -> list[str]:
    return [
        "hparams_search=optuna",
        "hooks=[slow]",
        "trainer.max_epochs=4",
        "data.batch_size=64",
        "hydra.sweeper.study_name=outage",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweep.dir={sweep}",
        *extra,
    ]


def _when_training(sweep: Path, workers: list) -> None:
    """Wait until a job has saved an epoch's checkpoint (it trains on; the study has its trial)."""
    deadline = time.time() + 300
    while not list(sweep.glob("[0-9]*/checkpoints/epoch_1.pth")):
        assert time.time() < deadline and all(p.poll() is None for p, _ in workers), [
            out.read_text()[-2000:] for _, out in workers
        ]
        time.sleep(0.02)


def test_a_database_restart_during_a_two_worker_search_loses_nothing(tmp_path, postgres_server):
    sweep = tmp_path / "sweep"
    args = _search(postgres_server.url, sweep, "hydra.sweeper.n_trials=4")
    workers = [search_worker(tmp_path, f"w{i}", *args) for i in range(2)]
    try:
        _when_training(sweep, workers)
        postgres_server.stop()  # every connection dropped, as in a crash
        time.sleep(4)
        postgres_server.start()
        finish_workers(workers)  # both exit 0
    finally:
        kill_workers(workers)
    output = "".join(out.read_text() for _, out in workers)
    assert "Optuna storage unreachable while" in output and "trying again" in output  # (the outage was seen)
    assert "Traceback" not in output
    study = optuna.load_study(study_name="outage", storage=open_storage(postgres_server.url))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4  # none failed, none left running
    for job in (p for p in sweep.iterdir() if p.name.isdigit()):
        assert json.loads((job / "result.json").read_text())["status"] == "completed", job


def test_a_storage_that_stays_down_stops_the_worker_and_resume_finishes_its_trial(tmp_path, postgres_server):
    sweep = tmp_path / "sweep"
    args = _search(postgres_server.url, sweep, "hydra.sweeper.n_trials=2", "hydra.sweeper.storage_wait_s=3")
    workers = [search_worker(tmp_path, "w0", *args)]
    try:
        _when_training(sweep, workers)
        postgres_server.stop()
        proc, out = workers[0]
        assert proc.wait(timeout=120) == 1, out.read_text()[-3000:]
    finally:
        kill_workers(workers)
    output = out.read_text()
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("Error: ") or "] Error: " in line]
    assert len(errors) == 1 and "the Optuna storage did not answer" in errors[0] and "resume=true" in errors[0]
    job = next(p for p in sweep.iterdir() if p.name.isdigit())
    result = json.loads((job / "result.json").read_text())
    assert result["status"] == "stopped" and result["stop_reason"].startswith("interrupted: the Optuna storage"), result
    assert not any(k.startswith("test/") for k in result["final_metrics"])  # (the test waits for the resume)

    postgres_server.start()
    resumed = subprocess.run(
        [proc.args[0], *proc.args[1:], "resume=true"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    study = optuna.load_study(study_name="outage", storage=open_storage(postgres_server.url))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2  # the stopped trial, then one more
    result = json.loads((job / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_in_sweep"] is True  # from its checkpoint
