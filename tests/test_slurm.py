"""On a real one-node Slurm cluster (``slurm_cluster``: slurmctld, slurmd, slurmdbd on 127.0.0.1):
a plain ``sbatch`` job, and a sweep through Hydra's own submitit launcher."""

from __future__ import annotations

import csv
import json
import re
import sys
import time

import pytest
from conftest import run_cli
from slurm_fixture import slurm_cluster  # noqa: F401 (the session's cluster)

pytestmark = pytest.mark.slow


def _accounted_state(cluster, job_id: str, timeout: float = 30) -> str:
    """The job's state as sacct (slurmdbd) has it; slurmctld sends it a moment after the job ends."""
    deadline = time.monotonic() + timeout
    while True:
        proc = cluster.run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State")
        state = proc.stdout.strip()
        if state not in ("", "PENDING", "RUNNING", "COMPLETING") or time.monotonic() > deadline:
            return f"{state} {proc.stderr.strip()}".strip()
        time.sleep(0.5)


def test_sbatch_wait_runs_a_python_job_and_sacct_records_it_completed(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "job.sh"
    code = 'import os; print("job", os.environ["SLURM_JOB_ID"], 6 * 7)'
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{code}'\n")
    out = tmp_path / "out.txt"
    proc = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", "--time=2", f"--output={out}", f"--chdir={tmp_path}", str(script), timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + slurm_cluster.log()
    job_id = proc.stdout.strip().split(";")[0]
    assert out.read_text() == f"job {job_id} 42\n"
    assert _accounted_state(slurm_cluster, job_id) == "COMPLETED", slurm_cluster.log("slurmdbd")


def test_submitit_slurm_sweep_runs_each_job_on_the_cluster(slurm_cluster, tmp_path):  # noqa: F811
    # On this one-node cluster submitit_slurm's defaults work (partition=null: the default partition;
    # mem_gb=null: DefMemPerCPU, half the memory per job on 2 CPUs; timeout_min=60). Set here as a
    # user would: the partition, one CPU and a little memory each, so that both jobs run side by
    # side on 2 CPUs, and a limit above 2 min (submitit's USR2 comes signal_delay_s=120 s before it).
    launcher = [
        "hydra/launcher=submitit_slurm",
        f"hydra.launcher.partition={slurm_cluster.partition}",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=2",
        "hydra.launcher.timeout_min=10",
    ]
    proc = run_cli(
        "-m",
        *launcher,
        "optim.lr=0.1,0.05",
        "trainer.max_epochs=1",
        f"hydra.sweep.dir={tmp_path}",
        env={**slurm_cluster.env, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.output + slurm_cluster.log()
    for job in ("0", "1"):
        result = json.loads((tmp_path / job / "result.json").read_text())
        assert result["status"] == "completed", result
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert sorted(r["job"] for r in rows) == ["0", "1"] and {r["status"] for r in rows} == {"completed"}
    # each job really ran as a Slurm job (its array task), and sacct has both
    job_ids = sorted(p.name for p in (tmp_path / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 2, job_ids
    for job_id in job_ids:
        assert _accounted_state(slurm_cluster, job_id) == "COMPLETED", slurm_cluster.log("slurmdbd")
