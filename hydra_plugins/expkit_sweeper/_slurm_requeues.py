"""A launch through Hydra's submitit Slurm launcher that waits for the jobs Slurm itself requeued.

When a node fails under a job submitted with ``--requeue``, Slurm records the attempt that ended
as ``NODE_FAIL`` and puts the job back in the queue at once. submitit's watcher asks ``sacct``,
may read that ``NODE_FAIL`` before the job runs again, takes the job for finished, and the
launcher raises ``UncompletedJobError`` ("has not produced any output"): the sweep ended while
its job was about to resume (issue 65). Here the launcher's error is checked against what
slurmctld says of the job now (``scontrol show job``): a job back in the queue is waited for, and
the batch's results are read once every job of it has left the queue, through submitit's own
``SlurmJob`` for the same job ids. Any other error is the launcher's, as it was.

A launch that returns may also have read results that earlier attempts left while Slurm runs the
job again: the ranks other than 0 of a multi-node job return at submitit's signal (submitit
requeues from rank 0 only), and a rank that could not learn from slurmctld that its SIGTERM was a
requeue returns as after a cancel; their result files stay while the job is back in the queue, and
once every task has one, submitit takes the job for done. So a job that recorded itself stopped
to be continued (a signal, its time limit) is asked about once more (``scontrol show job``); while
Slurm still holds it, it is waited for and its result read again. A job that ran to its end after
a requeue (``requeues`` in its record) has its result read again, once rank 0's result file is
newer than the record (a later attempt may have ended while the launch read other jobs). A job
never requeued costs nothing more.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["FINISHED", "launch_through_requeues", "uncompleted_job"]

log = logging.getLogger(__name__)

# slurmctld's states of a job that has left the queue for good; any other state (PENDING,
# RUNNING, COMPLETING, REQUEUED, SUSPENDED, ...) comes back to RUNNING or to one of these
FINISHED = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
POLL_S = 10.0  # between two `scontrol show job` calls while a requeued job waits or runs
PATIENCE_S = 600.0  # scontrol failing this long in a row (slurmctld down): the wait ends, the error is submitit's
SAY_EVERY_S = 600.0  # a line now and then while a job waits (a held job waits until someone releases it)
RESULT_LAG_S = 10.0  # a requeued job that left the queue: its last result file at most this long after its record


def uncompleted_job(exc: BaseException) -> str | None:
    """The job submitit's ``UncompletedJobError`` names ("Job 1234_5 (task: 0) with path ... has not
    produced any output (state: NODE_FAIL)").

    Args:
        exc: the error a launch raised.

    Returns:
        The job id; None for another error, or another wording (another submitit version).
    """
    if type(exc).__name__ != "UncompletedJobError" or "submitit" not in type(exc).__module__:
        return None
    found = re.match(r"Job (\S+) \(task: \d+\)", str(exc))
    return found.group(1) if found else None


def launch_through_requeues(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
    """``launcher.launch(job_overrides, initial_job_idx)``, continued past a job that submitit took
    for finished while Slurm had requeued it, or whose result it read while Slurm still held it.

    Args:
        launcher: the sweep's launcher: Hydra's submitit Slurm launcher.
        job_overrides: the batch's jobs, as Hydra's ``Launcher.launch`` takes them.
        initial_job_idx: the first job's index in the sweep.

    Returns:
        The batch's ``JobReturn`` list, in the order of `job_overrides`.

    Raises:
        Exception: the launcher's own error, when the job it names is not in Slurm's queue again.
    """
    from expkit.core.slurm import NO_ANSWER, job_state

    try:
        returns = launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
    except Exception as exc:
        jid = uncompleted_job(exc)
        state = None if jid is None else job_state(jid)
        if jid is None or state in (None, NO_ANSWER) or state in FINISHED:
            raise
        log.warning("Slurm requeued job %s (%s now; submitit read it as ended): waiting for it", jid, state)
        array, _, index = jid.partition("_")  # one sbatch --array of the batch, tasks 0..n-1; or one job
        ids = [f"{array}_{k}" for k in range(len(job_overrides))] if index else [jid]
        return [_result(launcher, i) for i in ids]
    return [_unless_held(launcher, r) for r in returns]


def _unless_held(launcher: Any, ret: Any) -> Any:
    """`ret`, a job's return as the launch read it; or the job's return read again, when `ret` may be
    an earlier attempt's: the job's record says it stopped to be continued and Slurm still holds it
    (queued again, running, completing: it is waited for), or it ran to its end after Slurm had
    requeued it (``requeues`` in its record: rank 0's result file is read once it is newer than the
    record, as the last attempt writes it)."""
    from omegaconf import OmegaConf

    from expkit.core.slurm import NO_ANSWER, job_state
    from expkit.sweeps.sweep_jobs import finished, job_result

    hydra_cfg = getattr(ret, "hydra_cfg", None)  # (the job's dir: its output dir; working_dir is the cwd)
    if hydra_cfg is None:
        return ret
    work_dir, jid = (OmegaConf.select(hydra_cfg, key) for key in ("hydra.runtime.output_dir", "hydra.job.id"))
    result = job_result(Path(work_dir)) if work_dir and jid else None
    if result is None:
        return ret
    if result.get("status") != "stopped" or finished(result):
        return _read_again(launcher, str(jid), Path(work_dir), ret) if result.get("requeues") else ret
    state = job_state(str(jid))
    if state not in (None, NO_ANSWER) and state not in FINISHED:  # (a job that ended may be leaving the queue)
        time.sleep(1.0)
        state = job_state(str(jid))
    if state in (None, NO_ANSWER) or state in FINISHED:
        return ret
    log.warning("Job %s recorded itself stopped, and Slurm still holds it (%s): waiting for its end", jid, state)
    return _result(launcher, str(jid), ret)


def _read_again(launcher: Any, jid: str, work_dir: Path, ret: Any) -> Any:
    """A requeued job's return as its last attempt left it, read with every task's: at once when
    rank 0's result file is newer than the job's record (the attempt writes the record, then
    returns); once Slurm is done with it when Slurm still holds the job; else once the file comes,
    ``RESULT_LAG_S`` at most. `ret` when none comes or it cannot be read."""
    from submitit.core.utils import FailedJobError, JobPaths, UncompletedJobError

    from expkit.core.slurm import NO_ANSWER, job_state
    from expkit.sweeps.sweep_jobs import job_target
    from expkit.workdir.records import RESULT

    params = launcher.params
    read = JobPaths(str(params["submitit_folder"]), job_id=jid, task_id=0).result_pickle
    record = job_target(work_dir) / RESULT
    try:
        if read.stat().st_mtime < record.stat().st_mtime:
            state = job_state(jid)
            if state not in (None, NO_ANSWER) and state not in FINISHED:
                return _result(launcher, jid, ret)
            deadline = time.monotonic() + RESULT_LAG_S
            while read.stat().st_mtime < record.stat().st_mtime:
                if time.monotonic() > deadline:
                    return ret
                time.sleep(0.5)
        return _rank0_return(launcher, jid)
    except (OSError, UncompletedJobError, FailedJobError):  # (another task's file may be an earlier attempt's)
        return ret


def _result(launcher: Any, jid: str, early: Any = None) -> Any:
    """Rank 0's return of job `jid` (what Hydra's launcher takes of a job, having read every task's,
    so that a task's error is raised), once Slurm says the job has left the queue. With `early`
    (the return the launch read): `early` again when the job left no result of its last attempt."""
    from submitit.core.utils import UncompletedJobError

    from expkit.core.slurm import NO_ANSWER, job_state

    unanswered = said = time.monotonic()
    while (state := job_state(jid)) is not None and state not in FINISHED:
        now = time.monotonic()
        if state != NO_ANSWER:
            unanswered = now
        elif now - unanswered > PATIENCE_S:
            log.warning("Slurm has not answered about job %s for %.0f s: taking it as ended", jid, now - unanswered)
            break
        if now - said > SAY_EVERY_S:
            log.info("Still waiting for job %s (%s)", jid, state)
            said = now
        time.sleep(1.0 if state == "COMPLETING" else POLL_S)  # (a job completing leaves in a moment)
    try:
        return _rank0_return(launcher, jid)
    except UncompletedJobError as exc:
        if early is None:
            raise
        why = (str(exc).splitlines() or [type(exc).__name__])[0]  # (its record says how it stands)
        log.warning("Job %s ended without a result of its last attempt (%s): its record stays", jid, why)
        return early


def _rank0_return(launcher: Any, jid: str) -> Any:
    """Rank 0's return of job `jid` as its result files hold it, every task's read (so that a task's
    error is raised), through submitit's own ``SlurmJob``."""
    import submitit

    params = launcher.params
    tasks = int(params.get("nodes") or 1) * int(params.get("tasks_per_node") or 1)
    return submitit.SlurmJob(folder=str(params["submitit_folder"]), job_id=jid, tasks=tuple(range(tasks))).results()[0]
