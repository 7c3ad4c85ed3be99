"""A plain ``sbatch`` job preempted on the real cluster (``slurm_cluster``), through the preemption
benchmark itself (``benchmarks/preemption.py``), so that the benchmark cannot rot either."""

from __future__ import annotations

import json
import subprocess
import sys

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
