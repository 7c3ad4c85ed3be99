"""A plain ``sbatch`` job preempted on the real cluster (``slurm_cluster``), through the preemption
benchmark itself (``benchmarks/preemption.py``), so that the benchmark cannot rot either."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import REPO
from slurm_fixture import last_node, slurm_cluster  # noqa: F401 (the session's cluster, its last node)

pytestmark = pytest.mark.slow


@pytest.mark.long(seconds=90)
def test_a_preempted_sbatch_job_requeues_itself_and_trains_no_iteration_twice(
    slurm_cluster,  # noqa: F811
    last_node,  # noqa: F811
    tmp_path,
):
    """A two-node sbatch job (``--requeue``) is preempted by a job of the ``urgent`` partition: its
    ranks save at Slurm's SIGTERM, rank 0 requeues the job (a job that ends within its grace time
    would otherwise be recorded as ended, never to start again), and the next attempt resumes from
    that save: not one iteration is trained twice."""
    rows = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/preemption.py", "--preemptions", "1", "--json", str(rows)],
        cwd=REPO,
        env=slurm_cluster.environ(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + slurm_cluster.log()
    (row,) = json.loads(rows.read_text())
    assert row["iterations trained twice"] == 0, row
    assert 0 < row["signal to training again"] < 300, row
    assert "| signal to training again |" in proc.stdout


def test_a_requeued_job_that_slurm_does_not_answer_at_once_asks_again_and_is_not_taken_for_cancelled(
    slurm_cluster,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """SIGTERM comes from a requeue as from a cancel; a stopped rank asks slurmctld which it was
    (``being_requeued``). slurmctld busy with that very requeue may fail to answer: an ``scontrol``
    on the PATH fails its first two calls as a busy slurmctld does, and the rank asks again and
    learns that the job comes back. One that never answers is a cancel (the rank returns) once
    ``ASK_FOR_S`` has passed (the questions twice as far apart each time)."""
    from expkit.core import slurm

    submitted = slurm_cluster.run(
        "sbatch", "--parsable", "--requeue", "--time=2", f"--output={tmp_path / 'out.txt'}", "--wrap", "sleep 60"
    )
    assert submitted.returncode == 0, submitted.stderr + slurm_cluster.log()
    job = submitted.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 60
        while "JobState=RUNNING" not in slurm_cluster.run("scontrol", "show", "job", job).stdout:
            assert time.monotonic() < deadline, slurm_cluster.log()
            time.sleep(0.3)
        assert slurm_cluster.run("scontrol", "requeue", job).returncode == 0
        calls, shim = tmp_path / "calls", tmp_path / "shim"
        shim.mkdir()
        (shim / "scontrol").write_text(
            "#!/bin/sh\n"
            f"echo x >> {calls}\n"
            f'if [ "$(wc -l < {calls})" -le "${{FAILS:-2}}" ]; then\n'
            '  echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1; fi\n'
            f'exec {shutil.which("scontrol")} "$@"\n'
        )
        (shim / "scontrol").chmod(0o755)
        for key, value in {**slurm_cluster.env, "SLURM_JOB_ID": job, "PATH": f"{shim}:{os.environ['PATH']}"}.items():
            monkeypatch.setenv(key, value)
        assert slurm.being_requeued(0) is True
        assert len(calls.read_text().splitlines()) == 3  # two unanswered, then the answer
        calls.unlink()
        monkeypatch.setenv("FAILS", "1000")
        monkeypatch.setattr(slurm, "ASK_FOR_S", 4.0)
        begun = time.monotonic()
        assert slurm.being_requeued(0) is False  # (never answered: taken for a cancel)
        assert 4.0 <= time.monotonic() - begun < 4.0 + 5  # asked at 0, 1, 3 and 4 s: the 4 s are spent
        assert len(calls.read_text().splitlines()) in (3, 4)  # (3 when the first three took a second)
    finally:
        slurm_cluster.run("scancel", job)
