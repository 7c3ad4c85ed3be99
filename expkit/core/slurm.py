"""What a run asks Slurm about its own job: when it ends, whether it may be requeued, and the
requeue itself (``scontrol``), each asked once, never in the loop.

Outside Slurm (no ``SLURM_JOB_ID``) nothing here starts a process. Inside a job started by
submitit, submitit requeues the job itself (``expkit.core.signals.hand_over``): these are for a
job the user submitted with ``sbatch``.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass

__all__ = ["SlurmJob", "job_id", "requeue", "this_job"]


log = logging.getLogger("expkit")

# scontrol can hang while slurmctld is unreachable (it retries): a run never waits longer on it
SCONTROL_TIMEOUT_S = 30


def job_id() -> str | None:
    """This process's Slurm job: ``SLURM_JOB_ID`` (an array task has a job id of its own too).

    Returns:
        The job id; None outside Slurm.
    """
    return os.environ.get("SLURM_JOB_ID") or None


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol show job`` says of this job, read once.

    Args:
        job_id: the job's id.
        end_time: when Slurm ends the job (its time limit), as ``time.time()`` seconds; None when it has
            no limit or Slurm did not say.
        requeue: whether the job may be requeued (``sbatch --requeue``, or the cluster's ``JobRequeue=1``).
    """

    job_id: str
    end_time: float | None
    requeue: bool


def this_job() -> SlurmJob | None:
    """This job as slurmctld knows it (one ``scontrol show job`` call).

    Returns:
        The job; None outside Slurm, or when scontrol is missing, fails or does not answer in time.
    """
    jid = job_id()
    if jid is None:
        return None
    try:
        proc = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", jid],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("Could not ask Slurm about job %s: %s", jid, exc)
        return None
    if proc.returncode != 0:
        log.warning("Could not ask Slurm about job %s: %s", jid, proc.stderr.strip() or f"exit {proc.returncode}")
        return None
    return SlurmJob(jid, _end_time(proc.stdout), re.search(r"\bRequeue=1\b", proc.stdout) is not None)


def _end_time(scontrol_line: str) -> float | None:
    """``EndTime=2026-11-27T21:02:01`` (the cluster's local time) as ``time.time()`` seconds; None
    for ``Unknown`` or ``None`` (no time limit)."""
    found = re.search(r"\bEndTime=(\S+)", scontrol_line)
    try:
        return time.mktime(time.strptime(found.group(1), "%Y-%m-%dT%H:%M:%S")) if found else None
    except ValueError:
        return None


def requeue(job: SlurmJob | None = None) -> str | None:
    """Put this job back in the queue (``scontrol requeue``): Slurm ends it now and starts it again,
    with ``SLURM_RESTART_COUNT`` one higher.

    Args:
        job: this job as read before (``this_job``); None: read it now.

    Returns:
        None when the job was requeued; else why not, in a few words (not under Slurm, submitted with
            ``--no-requeue``, scontrol failed).
    """
    job = job or this_job()
    if job is None:
        return "not a Slurm job, or Slurm did not answer"
    if not job.requeue:
        return f"job {job.job_id} may not be requeued (submit it with sbatch --requeue)"
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job.job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job.job_id}: {exc}"
    if proc.returncode != 0:
        return f"scontrol requeue {job.job_id}: {proc.stderr.strip() or f'exit {proc.returncode}'}"
    return None
