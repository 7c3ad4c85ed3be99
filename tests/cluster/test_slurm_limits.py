"""A hand-written sbatch job on the real one-node cluster (``slurm_cluster``) that expkit requeues
itself: at the requeue signal (``scancel --signal=USR1``, as ``sbatch --signal=USR1@N`` sends it
before the limit), and ahead of its time limit (``trainer.save_before_limit``). Each time the job
saves, runs ``scontrol requeue`` on itself, and its next start (``resume=true``) continues the run
to the end of an uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_same_weights, slow_train
from slurm_fixture import slurm_cluster  # noqa: F401 (the session's cluster)

pytestmark = pytest.mark.slow

COMMON = ["trainer.max_epochs=20", "default_hooks.logger.plot=false"]


def _reference(tmp_path: Path) -> subprocess.Popen:
    """The same run, uninterrupted and outside Slurm, started beside the job."""
    return subprocess.Popen(
        [sys.executable, "-m", "expkit.train", f"hydra.run.dir={tmp_path / 'reference'}", *COMMON],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _submit(cluster, tmp_path: Path, *sbatch: str, args: tuple[str, ...] = ()) -> str:
    work = tmp_path / "run"
    train = slow_train(tmp_path, f"hydra.run.dir={work}", "resume=true")
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nexec srun " + " ".join([*train, *COMMON, *args]) + "\n")
    proc = cluster.run(
        "sbatch",
        "--parsable",
        "--requeue",
        "--open-mode=append",
        f"--output={tmp_path / 'slurm.out'}",
        f"--chdir={REPO}",
        f"--export=ALL,PYTHONPATH={tmp_path},OMP_NUM_THREADS=1",
        *sbatch,
        str(script),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + cluster.log()
    return proc.stdout.strip().split(";")[0]


def _wait_until_gone(cluster, job_id: str, tmp_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while cluster.run("squeue", "-h", "-j", job_id).stdout.strip():
        assert time.monotonic() < deadline, _story(cluster, tmp_path)
        time.sleep(1)


def _output(tmp_path: Path) -> str:
    """The job's output, every start of it (sbatch --open-mode=append)."""
    out = tmp_path / "slurm.out"
    return out.read_text() if out.exists() else "(no output)"


def _story(cluster, tmp_path: Path) -> str:
    return _output(tmp_path)[-4000:] + "\n" + cluster.log()


def _check_resumed_exactly(tmp_path: Path, reference: subprocess.Popen) -> dict:
    assert reference.wait(timeout=300) == 0
    assert_same_weights(tmp_path / "run", tmp_path / "reference", "epoch_20.pth")
    return json.loads((tmp_path / "run" / "result.json").read_text())


@pytest.mark.long(seconds=100)
def test_the_requeue_signal_saves_requeues_the_job_and_its_next_start_resumes_exactly(slurm_cluster, tmp_path):  # noqa: F811
    reference = _reference(tmp_path)
    job_id = _submit(slurm_cluster, tmp_path, "--time=5")
    epoch_3 = tmp_path / "run" / "checkpoints" / "epoch_3.pth"
    deadline = time.monotonic() + 180
    while not epoch_3.exists():
        assert time.monotonic() < deadline, _story(slurm_cluster, tmp_path)
        time.sleep(0.2)
    signalled = slurm_cluster.run("scancel", "--signal=USR1", job_id)  # (the job's steps: srun's task)
    assert signalled.returncode == 0, signalled.stderr
    _wait_until_gone(slurm_cluster, job_id, tmp_path, timeout=300)

    output, story = _output(tmp_path), _story(slurm_cluster, tmp_path)
    assert "Stop requested: signal SIGUSR1" in output and f"Requeued Slurm job {job_id}" in output, story
    result = _check_resumed_exactly(tmp_path, reference)
    assert result["status"] == "completed" and result["requeues"] == 1, story
    restarts = slurm_cluster.run("scontrol", "show", "job", job_id).stdout  # (still known shortly after)
    assert "Restarts=1" in restarts or not restarts, restarts


@pytest.mark.long(seconds=90)
def test_save_before_limit_stops_ahead_of_the_time_limit_and_requeues(slurm_cluster, tmp_path):  # noqa: F811
    """A 2-minute job with an 80 s margin: the run stops itself about 40 s in, far from Slurm's
    kill, saves, requeues its job, and the next start finishes (the whole run needs about 50 s)."""
    reference = _reference(tmp_path)
    job_id = _submit(slurm_cluster, tmp_path, "--time=2", args=("trainer.limit_margin_s=80",))
    _wait_until_gone(slurm_cluster, job_id, tmp_path, timeout=420)

    output, story = _output(tmp_path), _story(slurm_cluster, tmp_path)
    assert "Stop requested: interrupted: " in output and "trainer.save_before_limit" in output, story
    assert f"Requeued Slurm job {job_id}" in output and "DUE TO TIME LIMIT" not in output, story
    result = _check_resumed_exactly(tmp_path, reference)
    assert result["status"] == "completed" and result["requeues"] >= 1, story
