"""A sweep in MLflow: one parent run, named after the sweep dir, with each job's run its child
(MLflow's own nested runs: the tag ``mlflow.parentRunId``), in the sweep's experiment.

The parent is found by its tag ``expkit.sweep_dir`` (the sweep dir's absolute path), so a
resumed or re-run sweep, a requeued Slurm job and a second Optuna worker all find the one
parent the first job made. Jobs run in processes of their own (joblib, submitit, Slurm), so
finding it and making it happen under an exclusive ``flock`` on ``<sweep dir>/.mlflow_parent.lock``:
of two jobs that start together, the second waits and then finds the first one's parent (the
kernel drops the lock of a process that dies; NFS clients honour flock across hosts).

The ids are passed explicitly through ``MlflowClient``, never through MLflow's fluent API, so
an ``MLFLOW_RUN_ID`` in the environment (which ``mlflow.start_run`` would take as the run to
continue, whatever parent it is given: mlflow#15713) changes nothing here.

At the end of a sweep, its launching process (``SweepSummaryCallback``) gives the parent the
best job's metrics (its ``best/*`` and ``final/*``, as its own run has them; with seed groups
also the best group's ``group_mean/<metric>`` and ``group_std/<metric>``), tags naming the best
job, summary.md as the run's description, and summary.md, summary.csv, best.json and sweep.svg
as artifacts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from expkit.core.confine import confined
from expkit.workdir.records import BEST_FILE, read_best, read_result

__all__ = [
    "LOCK_NAME",
    "NOTE_LIMIT",
    "PARENT_RUN_TAG",
    "SUMMARY_ARTIFACTS",
    "SWEEP_DIR_TAG",
    "find_sweep_parent",
    "log_sweep_summary",
    "sweep_parent",
]

log = logging.getLogger("expkit")

PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a run under the run it names
SWEEP_DIR_TAG = "expkit.sweep_dir"  # a sweep's parent run: the sweep dir's absolute path
LOCK_NAME = ".mlflow_parent.lock"  # in the sweep dir: one process at a time finds or makes the parent
NOTE_LIMIT = 5000  # characters of summary.md in the run's description (MLflow tags hold 8000)
SUMMARY_ARTIFACTS = ("summary.md", "summary.csv", BEST_FILE, "sweep.svg")


@contextlib.contextmanager
def _locked(sweep_dir: Path) -> Iterator[None]:
    fd = os.open(sweep_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock


def find_sweep_parent(client: Any, experiment_id: str, sweep_dir: Path) -> Any | None:
    """The active parent run of the sweep in `sweep_dir`, or None.

    Args:
        client: an ``MlflowClient``.
        experiment_id: the sweep's experiment.
        sweep_dir: the sweep dir (its absolute path is the parent's ``expkit.sweep_dir`` tag).

    Returns:
        The oldest such run (``mlflow.entities.Run``), or None.
    """
    wanted = str(sweep_dir.resolve())
    # (matched here, not in the filter: a path may hold quotes, which MLflow's filter cannot escape)
    found = client.search_runs([experiment_id], filter_string=f"tags.`{SWEEP_DIR_TAG}` != ''", max_results=1000)
    parents = [run for run in found if run.data.tags.get(SWEEP_DIR_TAG) == wanted]
    return min(parents, key=lambda run: run.info.start_time or 0, default=None)


def sweep_parent(client: Any, experiment_id: str, sweep_dir: Path) -> str:
    """The id of the sweep's parent run, made (RUNNING) if the sweep has none yet, or marked
    RUNNING again when a resumed sweep starts a job under a parent that had ended.

    Args:
        client: an ``MlflowClient``.
        experiment_id: the sweep's experiment (the parent and its children share it).
        sweep_dir: the sweep dir; it must exist (its lock file is made there).

    Returns:
        The parent run's id.
    """
    with _locked(sweep_dir):
        run = find_sweep_parent(client, experiment_id, sweep_dir)
        if run is None:
            tags = {SWEEP_DIR_TAG: str(sweep_dir.resolve()), "sweep": sweep_dir.name}
            run = client.create_run(experiment_id, run_name=sweep_dir.name, tags=tags)
        elif run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        return str(run.info.run_id)


def _best_job_metrics(sweep_dir: Path, best: dict[str, Any]) -> dict[str, float]:
    """The best job's ``best/*`` and ``final/*`` from its result.json (its dir confined to the
    sweep dir), and a seed group's mean and std."""
    values: dict[str, Any] = {}
    job_dir = confined(sweep_dir, best.get("work_dir"), sweep_dir / BEST_FILE, "job dir") if best.get("job") else None
    result = read_result(job_dir) if job_dir is not None else None
    if result is not None:
        values.update({f"best/{k}": v.get("value") for k, v in (result.get("best_metrics") or {}).items()})
        values.update({f"final/{k}": v for k, v in (result.get("final_metrics") or {}).items()})
    if best.get("group") is not None:
        values[f"group_mean/{best['metric']}"] = best.get("mean")
        values[f"group_std/{best['metric']}"] = best.get("std")
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def log_sweep_summary(client: Any, parent: str, sweep_dir: Path, artifacts: bool = True) -> None:
    """Give the parent run the sweep's outcome (see the module docstring) and end it: KILLED when a
    job was stopped by a signal (the sweep is to be resumed), else FINISHED.

    Args:
        client: an ``MlflowClient``.
        parent: the parent run's id.
        sweep_dir: the sweep dir, its summary written.
        artifacts: store the summary files as the run's artifacts.
    """
    from mlflow.entities import Metric, RunTag

    best = read_best(sweep_dir) or {}
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in _best_job_metrics(sweep_dir, best).items()]
    tags = {"jobs": str(best.get("jobs", "")), "statuses": json.dumps(best.get("statuses", {}))}
    if best.get("job") is not None:
        tags.update(best_job=str(best["job"]), best_overrides=" ".join(best.get("overrides") or []))
        if best.get("best_checkpoint"):
            tags["best_checkpoint"] = str(best["best_checkpoint"])
    summary = sweep_dir / "summary.md"
    if summary.is_file():  # shown as the run's description
        tags["mlflow.note.content"] = summary.read_text(errors="replace")[:NOTE_LIMIT]
    client.log_batch(parent, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
    if artifacts:
        for name in SUMMARY_ARTIFACTS:
            if (sweep_dir / name).is_file():
                client.log_artifact(parent, str(sweep_dir / name))
    stopped = (best.get("statuses") or {}).get("interrupted", 0)
    client.set_terminated(parent, status="KILLED" if stopped else "FINISHED")
