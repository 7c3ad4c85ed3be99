"""What a run asks Slurm about its own job: when it ends, whether it may be requeued, and the
requeue itself (``scontrol``), each asked once, never in the loop.

Outside Slurm (no ``SLURM_JOB_ID``) nothing here starts a process. Inside a job started by
submitit, submitit requeues the job itself (``expkit.core.signals.hand_over``): these are for a
job the user submitted with ``sbatch``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import NamedTuple

from expkit.core.errors import ConfigError

__all__ = [
    "NO_ANSWER",
    "SlurmJob",
    "SlurmNodes",
    "being_requeued",
    "job_id",
    "job_state",
    "partition_nodes",
    "requeue",
    "this_job",
]


log = logging.getLogger("expkit")

# scontrol can hang while slurmctld is unreachable (it retries): a run never waits longer on it
SCONTROL_TIMEOUT_S = 30
# a stopped job asks whether Slurm restarts it for this long when Slurm does not answer at once (a
# last call may take 1 s more): within Slurm's KillWait (30 s by default) between its SIGTERM and
# its SIGKILL, less the save before the question
ASK_FOR_S = 15.0


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
        restarts: how many times Slurm has requeued it so far (``Restarts=``): one more than this
            attempt's ``SLURM_RESTART_COUNT`` once ``scontrol requeue`` or a preemption has ended it.
        preempted: whether a job of a higher priority preempted this attempt (``PreemptTime=`` set,
            not before this attempt's ``StartTime=``): Slurm's SIGTERM has come or is coming.
    """

    job_id: str
    end_time: float | None
    requeue: bool
    restarts: int = 0
    preempted: bool = False


def this_job(timeout: float = SCONTROL_TIMEOUT_S, warn: bool = True) -> SlurmJob | None:
    """This job as slurmctld knows it (one ``scontrol show job`` call).

    Args:
        timeout: seconds scontrol may take.
        warn: log a warning when Slurm does not answer.

    Returns:
        The job; None outside Slurm, or when scontrol is missing, fails or does not answer in time.
    """
    jid = job_id()
    if jid is None:
        return None
    shown, why = _scontrol_show_job(jid, timeout)
    if shown is None:
        if warn:
            log.warning("Could not ask Slurm about job %s: %s", jid, why)
        return None
    restarts = re.search(r"\bRestarts=(\d+)", shown)
    preempt_time, start_time = _end_time(shown, "PreemptTime"), _end_time(shown, "StartTime")
    return SlurmJob(
        jid,
        _end_time(shown),
        re.search(r"\bRequeue=1\b", shown) is not None,
        int(restarts.group(1)) if restarts else 0,
        preempt_time is not None and (start_time is None or preempt_time >= start_time),
    )


NO_ANSWER = "NO_ANSWER"  # job_state: scontrol failed or timed out (slurmctld busy or restarting)


def job_state(jid: str) -> str | None:
    """The state slurmctld gives job `jid` now (``JobState=``: PENDING, RUNNING, COMPLETED,
    NODE_FAIL, ...). A job Slurm requeued is PENDING again at once, whatever ``sacct`` recorded for
    the attempt that ended.

    Args:
        jid: the job's id (``1234``, or ``1234_5`` for a task of an array).

    Returns:
        The state; None when Slurm no longer knows the job (``MinJobAge`` after its end);
            ``NO_ANSWER`` when scontrol failed or did not answer in time (ask again).
    """
    shown, why = _scontrol_show_job(jid)
    if shown is None:
        return None if "Invalid job id" in why else NO_ANSWER
    found = re.search(r"\bJobState=(\w+)", shown)
    return found.group(1) if found else NO_ANSWER


def _scontrol_show_job(jid: str, timeout: float = SCONTROL_TIMEOUT_S) -> tuple[str | None, str]:
    """(``scontrol --oneliner show job <jid>``'s output, ""), or (None, why it failed: scontrol's
    own words, a missing program, a timeout)."""
    try:
        proc = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", jid],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if proc.returncode != 0:
        return None, proc.stderr.strip() or f"exit {proc.returncode}"
    return proc.stdout, ""


def _end_time(scontrol_line: str, field: str = "EndTime") -> float | None:
    """``EndTime=2026-11-27T21:02:01`` (the cluster's local time; or another time `field`) as
    ``time.time()`` seconds; None for ``Unknown`` or ``None`` (no time limit, not preempted)."""
    found = re.search(rf"\b{field}=(\S+)", scontrol_line)
    try:
        return time.mktime(time.strptime(found.group(1), "%Y-%m-%dT%H:%M:%S")) if found else None
    except ValueError:
        return None


def being_requeued(attempt: int, main: bool = True) -> bool:
    """Whether Slurm is ending this attempt of the job to start it again (``scontrol requeue``, a
    preemption with ``PreemptMode=REQUEUE``): its restart count is already past this attempt's, or
    the attempt was preempted. Asked once, when SIGTERM has stopped a run and it is saved and
    recorded: ``scancel`` sends the same signal.

    A preempted job is requeued here (``scontrol requeue``, by the main rank): with a ``GraceTime``,
    Slurm 22.05 sends SIGTERM and requeues the job only if it still runs when the grace time ends;
    one that saved and exited before is recorded COMPLETED and never starts again (issue 65).

    Args:
        attempt: this attempt's restart count (``SLURM_RESTART_COUNT``: ``distributed.requeue_count()``).
        main: whether this process requeues a preempted job (rank 0); the others only answer.

    Slurm not answering is asked again, for ``ASK_FOR_S`` in all: taken for a cancel, a requeued
    job's rank would return as if it had ended, and its result would stay while the job runs again
    (a sweep waits for such a job: ``hydra_plugins/expkit_sweeper/_slurm_requeues.py``).

    Returns:
        True when the job comes back; False for a cancel, outside Slurm, when Slurm does not answer, or
            when a preempted job may not be requeued.
    """
    deadline, pause = time.monotonic() + ASK_FOR_S, 1.0
    job = this_job(timeout=ASK_FOR_S)
    while job is None and job_id() is not None and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(pause, left))  # (slurmctld busy with the very requeue or cancel that sent SIGTERM)
        pause *= 2  # (every rank of the job asks: a busy slurmctld is not pressed harder; at 0, 1, 3, 7, 15 s)
        job = this_job(timeout=max(1.0, deadline - time.monotonic()), warn=False)
    if job is None or job.restarts > attempt:
        return job is not None
    if not job.preempted:
        return False
    why = requeue(job) if main else (None if job.requeue else "submitted with --no-requeue")
    if why is not None:
        log.warning("Preempted, and not requeued: %s", why)
    return why is None


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


class SlurmNodes(NamedTuple):
    """What the nodes of a partition have, as ``sinfo`` reports them.

    Args:
        gpus: GPUs per node (its ``gpu`` generic resources): the most any node has; 0 without GPUs.
        cpus: CPUs per node: the fewest any node has.
    """

    gpus: int
    cpus: int


@functools.cache
def partition_nodes(partition: str | None) -> SlurmNodes:
    """The nodes of `partition`, as ``sinfo`` reports them (``gpu:4``, ``gpu:a100:4(S:0-1)``: 4
    GPUs), asked where the jobs are submitted when the launcher is built: ``hydra/launcher=slurm_ddp``
    fills its defaults with them. Asked once per process and partition (its three defaults, each
    resolved again through the others, would otherwise run sinfo three times or more).

    Args:
        partition: the partition the jobs go to; None: the cluster's default one (``sinfo``'s ``*``).

    Returns:
        The GPUs and CPUs per node.

    Raises:
        ConfigError: sinfo is missing, fails, or does not know the partition.
    """
    fix = "or set hydra.launcher.gpus_per_node=N and cpus_per_task=N (gpus_per_node=0 on a cluster without GPUs)"
    try:
        proc = subprocess.run(
            ["sinfo", "--noheader", "--format=%P|%G|%c"],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(
            f"hydra/launcher=slurm_ddp: could not ask Slurm (sinfo) about its nodes: {exc}; {fix}"
        ) from None
    if proc.returncode != 0:
        why = proc.stderr.strip() or f"exit {proc.returncode}"
        raise ConfigError(f"hydra/launcher=slurm_ddp: sinfo failed ({why}); {fix}")
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 2]
    names = sorted({row[0].rstrip("*") for row in rows})
    wanted = [row for row in rows if (row[0].rstrip("*") == partition if partition else row[0].endswith("*"))]
    if not wanted:
        where = f"partition {partition!r}" if partition else "default partition"
        raise ConfigError(f"hydra.launcher.partition: the cluster has no {where}; its partitions: {', '.join(names)}")
    cpus = [int(row[2].rstrip("+")) for row in wanted if row[2].rstrip("+").isdigit()]
    return SlurmNodes(gpus=max(_gpu_count(row[1]) for row in wanted), cpus=min(cpus, default=1))


def _gpu_count(gres: str) -> int:
    """The GPUs in one ``sinfo %G`` field: ``gpu:4`` and ``gpu:a100:4(S:0-1)`` are 4, ``(null)`` 0."""
    count = 0
    for item in gres.split(","):
        found = re.fullmatch(r"gpu(?::[^:(]+)*?:(\d+)(?:\(.*\))?", item.strip())
        count += int(found.group(1)) if found else 0
    return count
