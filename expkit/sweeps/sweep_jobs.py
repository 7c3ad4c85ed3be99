"""A sweep job's identity and place: which dir holds which job, whether it still has to run.

Hydra numbers a sweep's jobs by position. expkit records each job's overrides in its dir
(``job.json``) and in an index (``<sweep>/.jobs/``), so that resuming a sweep (``-m ...
resume=true``), a Slurm requeue, or a second launch of the same sweep finds every job by
what it is, not where it came in the order: a finished job is not trained again, a running
one (another launch holds its lock) is skipped, an interrupted one continues.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from expkit.core import atomic, confine
from expkit.core.atomic import write_json_atomic, write_text_atomic
from expkit.core.signals import SweepInterrupted
from expkit.loggers import logs
from expkit.metrics import worst_value
from expkit.workdir.records import JOB_FILE, RESULT, read_job, read_result
from expkit.workdir.results import write_failure

__all__ = [
    "COMPUTE_KEYS",
    "CONTROL_KEYS",
    "FAIL_FAST_MARKER",
    "INDEX_COMPLETE",
    "INDEX_DIR",
    "JOB_FILE",
    "STOP_FILE",
    "SWEEP_JOBS_ENV",
    "SWEEP_LAUNCHED_ENV",
    "SWEEP_PID_ENV",
    "Claim",
    "best_value",
    "claim_job",
    "done_since_launch",
    "find_job",
    "finished",
    "finished_job_value",
    "in_launching_process",
    "job_failed",
    "job_identity",
    "job_order",
    "job_result",
    "job_target",
    "key_kind",
    "launch",
    "may_start",
    "own_job_dir",
    "place_job",
    "placed_job",
    "record_job",
    "request_stop",
    "restore_hydra_record",
    "resuming_sweep",
    "skip_busy_job",
    "stop_requested",
    "tally_jobs",
]


log = logging.getLogger("expkit")


def job_order(path: Path) -> tuple[int, str]:
    """Job dirs in Hydra's order: 0, 1, ..., 10 (not 0, 1, 10, 2).

    Args:
        path: a job dir of the sweep.

    Returns:
        The sort key: the length of the dir's name, then the name.
    """
    return len(path.name), path.name


SWEEP_LAUNCHED_ENV = "EXPKIT_SWEEP_LAUNCHED"  # when this launch of the sweep began (set by expkit's sweepers)


SWEEP_JOBS_ENV = "EXPKIT_SWEEP_JOBS"  # how many jobs this launch runs (set by expkit's sweepers)


SWEEP_PID_ENV = "EXPKIT_SWEEP_PID"  # the process that launches the jobs (the sweeper's)
STOP_FILE = ".stop"  # in the sweep dir: a signal stopped this launch; its jobs not started yet never start


@contextlib.contextmanager
def launch(jobs: int | None, sweep_dir: str | Path) -> Iterator[None]:
    """A sweeper's launch of `jobs` jobs into `sweep_dir`: its jobs (in this process, or in the
    workers it starts) are told when it began and how many jobs it runs (the first job projects
    the sweep's checkpoints against the free disk). A Ctrl-C or SIGTERM that stops it leaves as
    ``SweepInterrupted`` naming `sweep_dir`, which ``expkit.train.main`` reports.

    Args:
        jobs: how many jobs the launch runs, set as ``str(jobs)`` in ``EXPKIT_SWEEP_JOBS``; None
            (a sweep without a finite length) leaves it unset.
        sweep_dir: the sweep dir, named by the ``SweepInterrupted`` that leaves the block.

    Yields:
        None, once ``EXPKIT_SWEEP_LAUNCHED`` (the time now), ``EXPKIT_SWEEP_PID`` (this process) and
            ``EXPKIT_SWEEP_JOBS`` are set; they stay set after the block.

    Raises:
        SweepInterrupted: for a KeyboardInterrupt inside the block (with SIGINT), or one raised there,
            given the resolved `sweep_dir` when it names no sweep dir.
    """
    import signal
    import time

    os.environ[SWEEP_LAUNCHED_ENV] = repr(time.time())
    os.environ[SWEEP_PID_ENV] = str(os.getpid())
    if jobs is not None:
        os.environ[SWEEP_JOBS_ENV] = str(jobs)
    try:
        yield
    except KeyboardInterrupt:
        raise SweepInterrupted(signal.SIGINT, Path(sweep_dir).resolve()) from None
    except SweepInterrupted as exc:
        exc.sweep_dir = exc.sweep_dir or Path(sweep_dir).resolve()
        raise


def in_launching_process() -> bool:
    """Whether this job runs in the process that launches the sweep's jobs (Hydra's basic
    launcher), not in a worker (joblib, submitit).

    Returns:
        True when ``EXPKIT_SWEEP_PID`` is unset or names this process.
    """
    return os.environ.get(SWEEP_PID_ENV) in (None, str(os.getpid()))


def request_stop(sweep_dir: Path, signum: int) -> None:
    """A signal stops this launch: no job of it that has not started yet will start.

    Args:
        sweep_dir: the sweep dir, where ``.stop`` is written with the signal and this launch's start time
            (an OSError, e.g. a full disk, is ignored).
        signum: the signal that stopped it.
    """
    with contextlib.suppress(OSError):  # (a full disk: the jobs then stop on their own signal)
        write_json_atomic(sweep_dir / STOP_FILE, {"signal": signum, "launch": os.environ.get(SWEEP_LAUNCHED_ENV)})


def stop_requested(sweep_dir: Path) -> int | None:
    """The signal that stopped this launch of the sweep, if one did (a stop file of an earlier
    launch is stale: a resume starts everything again).

    Args:
        sweep_dir: the sweep dir whose ``.stop`` file is read.

    Returns:
        The signal number in the stop file when it was written by this launch (the same
            ``EXPKIT_SWEEP_LAUNCHED``); None when there is no readable stop file, it is another launch's,
            this process is in no launch, or it records no integer signal.
    """
    try:
        stop = json.loads((sweep_dir / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None
    launch = os.environ.get(SWEEP_LAUNCHED_ENV)
    if not isinstance(stop, dict) or launch is None or stop.get("launch") != launch:
        return None
    return stop.get("signal") if isinstance(stop.get("signal"), int) else None


# A sweep job is identified by what it computes. These keys (and everything under them) only
# control how a run goes: resuming, failing, printing, logging, where files go, how many are
# kept, how jobs are launched. They are never part of a job's identity, so that
# `resume=true retry_failed=true` or `logger=[tensorboard]` finds the same jobs. Every key of
# train.yaml, and every config group, is in one of the two lists (tests/sweeps/test_sweep_identity.py);
# the longest prefix decides; a key in neither (a user's own) counts as computing.
CONTROL_KEYS = (
    "hydra",
    "hydra_defaults",
    "resume",
    "retry_failed",
    "fail_fast",
    "show_hooks",
    "logger",
    "hparams_search",
    "seed_keys",
    "sweep_output",
    "default_hooks.logger",
    "default_hooks.timer",
    "default_hooks.runtime_info",
    "default_hooks.checkpoint",
    "data.num_workers",
    "data.pin_memory",
)
COMPUTE_KEYS = (
    "monitor",
    "load_from",
    "criterion",
    "metrics",
    "trainer",
    "data",
    "model",
    "optim",
    "sched",
    "hooks",
    "debug",
    "experiment",
    "default_hooks",
    "default_hooks.sampler_seed",
    "default_hooks.param_scheduler",
    "default_hooks.checkpoint.save_best",
    "default_hooks.checkpoint.rule",
    "default_hooks.checkpoint.greater_keys",
    "default_hooks.checkpoint.less_keys",  # (the best checkpoint is the test's weights)
)


def key_kind(key: str) -> str | None:
    """``control`` or ``compute`` for a config key (``a.b.c``) or group (``hydra/launcher``), by
    the longest listed prefix; None when no list holds it.

    Args:
        key: a config key or group, with or without a leading ``+``, ``++`` or ``~``.

    Returns:
        ``"control"`` or ``"compute"``: the list holding the longest prefix of `key` (`key` itself, or a
            part of it that ends before a ``.``); None when neither does.
    """
    key = key.lstrip("+~").replace("/", ".")
    best, kind = -1, None
    for listed, name in ((CONTROL_KEYS, "control"), (COMPUTE_KEYS, "compute")):
        for prefix in listed:
            if (key == prefix or key.startswith(prefix + ".")) and len(prefix) > best:
                best, kind = len(prefix), name
    return kind


def job_identity(overrides: list[str]) -> list[str]:
    """What makes a job the same job across launches: its overrides, sorted, without the ones
    that only control the run (CONTROL_KEYS); reordering values on the command line changes
    nothing.

    Args:
        overrides: the job's overrides, ``key=value`` each.

    Returns:
        The overrides whose key is not a control key (``key_kind``), sorted.
    """
    return sorted(o for o in overrides if key_kind(o.partition("=")[0]) != "control")


INDEX_DIR = ".jobs"  # <sweep>/.jobs/<digest of an identity>: the name of the dir holding that job
INDEX_COMPLETE = "complete-2"  # every job dir is in the index (2: identities without control keys)


def _index_key(identity: list[str]) -> str:
    import hashlib

    return hashlib.sha1(json.dumps(identity).encode()).hexdigest()[:20]


def record_job(work_dir: Path, identity: list[str]) -> None:
    """job.json: the identity, and a copy of the job's .hydra files (Hydra rewrites .hydra/ of
    <sweep>/<n> at every launch, so a resumed sweep with reordered values can put them back);
    and the sweep's index entry for the identity.

    Args:
        work_dir: the job dir; its ``.hydra/*.yaml`` files are copied into its job.json.
        identity: the job's identity (``job_identity``), recorded as ``overrides`` and keyed in the index
            ``<sweep>/.jobs/`` (the sweep being `work_dir`'s parent).
    """
    hydra_files = {p.name: p.read_text() for p in (work_dir / ".hydra").glob("*.yaml")}
    write_json_atomic(work_dir / JOB_FILE, {"overrides": identity, "hydra": hydra_files})
    write_text_atomic(work_dir.parent / INDEX_DIR / _index_key(identity), work_dir.name)


def restore_hydra_record(work_dir: Path, job: dict[str, Any]) -> None:
    """Put back the .hydra files a job.json copied: each name recorded there must be one
    ``.yaml`` name directly inside the job's own .hydra/ (the record is data: a crafted name
    is ignored with a warning, never written through).

    Args:
        work_dir: the job dir whose ``.hydra/`` gets the files back.
        job: the content of its job.json; its ``hydra`` entry maps file names to their text.
    """
    hydra_dir = work_dir / ".hydra"
    files = job.get("hydra")
    for name, text in files.items() if isinstance(files, dict) else ():
        target = confine.confined(hydra_dir, name, work_dir / JOB_FILE, ".hydra file")
        if target is None or not isinstance(text, str) or target.suffix != ".yaml":
            if target is not None:
                log.warning("Ignoring %r recorded in %s: not a .hydra/*.yaml record", name, work_dir / JOB_FILE)
            continue
        write_text_atomic(target, text)


# where this process placed the job of each of Hydra's job dirs (``claim_job``), for the summary's callback
# at the job's end, which runs in the same process: a dir that holds another job of an earlier launch
# (resume=true with values added) points nowhere, since its job.json is that job's
_PLACED: dict[Path, Path] = {}


def placed_job(hydra_dir: Path) -> Path:
    """Where the job that Hydra gave `hydra_dir` ran, once, for the callback at its end: the dir
    ``claim_job`` placed it in within this process, else ``job_target(hydra_dir)``.

    Args:
        hydra_dir: the job dir Hydra gave the job (``hydra.runtime.output_dir``).

    Returns:
        The dir the job ran in.
    """
    placed = _PLACED.pop(hydra_dir.resolve(), None)
    return placed if placed is not None else job_target(hydra_dir)


def job_target(work_dir: Path) -> Path:
    """Where the job of a sweep's job dir really ran (a resumed job's dir may point to another
    dir of the same sweep: alias_of; one that names anything else is ignored).

    Args:
        work_dir: a job dir of the sweep.

    Returns:
        The dir that job.json's ``alias_of`` names, when that is an existing dir directly in the same sweep
            dir; otherwise `work_dir`.
    """
    alias = (read_job(work_dir) or {}).get("alias_of")
    if not alias:
        return work_dir
    target = confine.confined(work_dir.parent, alias, work_dir / JOB_FILE, "job dir of this sweep")
    return target if target is not None and target.is_dir() else work_dir


def job_result(work_dir: Path) -> dict[str, Any] | None:
    """A job's result.json, where the job really ran.

    Args:
        work_dir: a job dir of the sweep.

    Returns:
        The content of ``result.json`` in ``job_target(work_dir)``; None when it is missing, cannot be read,
            is not JSON (a write cut short) or not a JSON object.
    """
    return read_result(job_target(work_dir))


def tally_jobs(sweep_dir: Path) -> dict[str, int]:
    """The jobs a sweep dir holds, by how they stand: completed (finished: completed, pruned,
    stopped by a hook), failed, interrupted (stopped by a signal or an outage, or no result
    yet), skipped (not run after an earlier job failed: ``fail_fast``); a job that a stop kept
    from starting is not counted.

    Args:
        sweep_dir: the sweep dir; each dir in it with a job.json that is not an alias is one job.

    Returns:
        ``{"completed": n, "interrupted": n, "failed": n}``, and ``"skipped": n`` when there are any.
    """
    counts = {"completed": 0, "interrupted": 0, "failed": 0, "skipped": 0}
    for job_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        job = read_job(job_dir)
        if job is None or "alias_of" in job:
            continue
        result = job_result(job_dir) or {}
        status = result.get("status")
        kind = "completed" if finished(result) else status if status in ("failed", "skipped") else "interrupted"
        counts[kind] += 1
    if not counts["skipped"]:
        del counts["skipped"]
    return counts


def finished(result: dict[str, Any]) -> bool:
    """Whether a job's result.json says it ran to its end: completed, pruned, or stopped by a
    hook (early stopping); a job stopped by a signal was preempted, and one stopped by an
    outage was interrupted (``interrupted: ...``): both go on when resumed.

    Args:
        result: the content of a job's result.json.

    Returns:
        True for status ``completed`` or ``pruned``, or ``stopped`` with a ``stop_reason`` that begins
            with neither ``signal`` nor ``interrupted``.
    """
    status, reason = result.get("status"), str(result.get("stop_reason") or "")
    return status in ("completed", "pruned") or (
        status == "stopped" and not reason.startswith(("signal", "interrupted"))
    )


def _identity_of(job: dict[str, Any]) -> list[str] | None:
    """A recorded job's identity, by today's rule (an older expkit kept some control keys)."""
    overrides = job.get("overrides")
    return job_identity([str(o) for o in overrides]) if isinstance(overrides, list) else None


def find_job(sweep_dir: Path, identity: list[str]) -> Path | None:
    """The dir in `sweep_dir` that holds the job with this identity, if any: one lookup in the
    sweep's index. A sweep dir whose index is not known complete (made by an older expkit, or
    a write lost to a crash) is scanned once, indexing every job, and then marked complete.

    Args:
        sweep_dir: the sweep dir.
        identity: the job's identity (``job_identity``).

    Returns:
        The job dir whose job.json records `identity` (an alias never counts); None when there is none.
    """
    index = sweep_dir / INDEX_DIR
    try:
        entry = index / _index_key(identity)
        candidate = confine.confined(sweep_dir, entry.read_text().strip(), entry, "job dir of this sweep")
        job = read_job(candidate) if candidate is not None and candidate.is_dir() else None
        if candidate is not None and job is not None and _identity_of(job) == identity and "alias_of" not in job:
            return candidate
    except OSError:
        pass
    if (index / INDEX_COMPLETE).is_file():
        return None
    found = None
    for candidate in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")), key=job_order
    ):
        job = read_job(candidate)
        if job is None or "alias_of" in job or not isinstance(job.get("overrides"), list):
            continue
        write_text_atomic(index / _index_key(_identity_of(job)), candidate.name)
        if found is None and _identity_of(job) == identity:
            found = candidate
    write_text_atomic(index / INDEX_COMPLETE, "")
    return found


def job_failed(
    exc: BaseException, work_dir: Path, sweep_dir: Path, rule: str, fail_fast: bool, message: str | None = None
) -> float:
    """In a sweep: record the failure, then either stop the sweep (fail_fast) or let it go on.

    Args:
        exc: what the job raised.
        work_dir: the job's work dir, whose result.json records the failure.
        sweep_dir: the sweep dir; with `fail_fast`, the ``.fail_fast`` marker (naming `work_dir`) is
            written in it.
        rule: the monitored metric's direction, ``"greater"`` or ``"less"``.
        fail_fast: stop the sweep: re-raise `exc` instead of returning.
        message: the failure's message; None: ``<exception type>: <exc>``.

    Returns:
        The worst value under `rule` (``worst_value``), for the job to return to the sweeper.

    Raises:
        BaseException: `exc` itself, re-raised when `fail_fast`.
    """
    message = message or f"{type(exc).__name__}: {exc}"
    write_failure(work_dir, message)
    log.error("Job failed: %s (work dir %s)", message, work_dir)
    if fail_fast:
        (sweep_dir / FAIL_FAST_MARKER).write_text(str(work_dir))
        raise exc
    return worst_value(rule)


FAIL_FAST_MARKER = ".fail_fast"


def resuming_sweep(cfg: DictConfig) -> bool:
    """resume=true: continue a sweep in its dir (a .pth path or false means something else).

    Args:
        cfg: the job's composed config.

    Returns:
        True when ``cfg.resume`` is true or the string ``true`` (in any case).
    """
    return str(cfg.resume).lower() == "true"


def place_job(cfg: DictConfig, overrides: list[str], hydra_dir: Path, sweep_dir: Path) -> Path:
    """The work dir of this sweep job. Hydra numbers jobs by position; with resume=true a job
    is found by its overrides instead (job.json), so reordered or added values mix nothing up.

    Args:
        cfg: the job's composed config (its ``resume``).
        overrides: the job's overrides.
        hydra_dir: the dir Hydra gave the job (``<sweep>/<n>``).
        sweep_dir: the sweep dir.

    Returns:
        `hydra_dir` when not resuming (the job recorded there), when it holds this job already, or when it
            holds no job and no dir holds this one (the job recorded there); else the dir that holds the
            job (a `hydra_dir` that held no job records ``alias_of`` it), or, when `hydra_dir` holds another
            job and no dir holds this one, a new ``<n>_<digest>`` dir recorded for it. When it is another
            dir than `hydra_dir`, the log goes to its ``train.log`` too.
    """
    identity = job_identity(overrides)
    if not resuming_sweep(cfg):
        record_job(hydra_dir, identity)
        return hydra_dir
    own = read_job(hydra_dir)
    if own is not None and _identity_of(own) == identity:
        return hydra_dir
    target = find_job(sweep_dir, identity)
    if own is None:  # a new dir
        if target is None:
            record_job(hydra_dir, identity)
            return hydra_dir
        write_json_atomic(hydra_dir / JOB_FILE, {"alias_of": str(target), "overrides": identity})
    else:  # the dir holds another job of the earlier launch: give it its record back
        current = {p.name: p.read_text() for p in (hydra_dir / ".hydra").glob("*.yaml")}  # this launch's
        restore_hydra_record(hydra_dir, own)
        if target is None:
            digest = hashlib.sha1(" ".join(identity).encode()).hexdigest()[:6]
            target = (sweep_dir / f"{hydra_dir.name}_{digest}").absolute()  # (as Hydra's own dirs)
            for name, text in current.items():
                atomic.write_text_atomic(target / ".hydra" / name, text)
            record_job(target, identity)
    log.info("Sweep job %s lives in %s", " ".join(identity), target)
    logs.log_to_file(target / "train.log")
    return target


def finished_job_value(cfg: DictConfig, work_dir: Path, rule: str, monitor: str) -> float | None:
    """With resume=true: a job that already finished is not trained again; its value is returned.

    Args:
        cfg: the job's composed config (its ``resume`` and ``retry_failed``).
        work_dir: the job's work dir, whose result.json is read.
        rule: the monitored metric's direction, used when result.json records no ``monitor_rule``.
        monitor: the monitored metric's key.

    Returns:
        The job's best value (``best_value``) when it finished; the worst value when it failed and
            ``retry_failed`` is off; None when not resuming, without a result.json, or when the job is to
            run (it did not finish, or failed and ``retry_failed`` is on).
    """
    result = read_result(work_dir) if resuming_sweep(cfg) else None
    if result is None:  # (unreadable: the job runs again, from its last complete checkpoint)
        return None
    rule = result.get("monitor_rule") or rule  # the direction the run itself used
    status = result.get("status")
    if status == "failed" and not cfg.retry_failed:
        log.info(
            "Job in %s failed before (%s); kept as failed (retry_failed=true retries it)", work_dir, result.get("error")
        )
        return worst_value(rule)
    if finished(result):
        log.info("Job in %s is already %s; not trained again", work_dir, status)
        return best_value(result, monitor, rule)
    return None  # interrupted, skipped or never finished: run it (resume=true continues it)


def best_value(result: dict[str, Any], monitor: str, rule: str) -> float:
    """The value a finished job returns to the sweeper: its best `monitor` value, never NaN.

    Args:
        result: the content of the job's result.json.
        monitor: the monitored metric's key, looked up in ``best_metrics``.
        rule: the monitored metric's direction, used when result.json records no ``monitor_rule``.

    Returns:
        The best value as a float when it is recorded and finite; otherwise the worst value (``worst_value``).
    """
    best = result.get("best_metrics")
    best = best.get(monitor) if isinstance(best, dict) else None
    value = best.get("value") if isinstance(best, dict) else None
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if finite else worst_value(result.get("monitor_rule") or rule)


def done_since_launch(work_dir: Path, monitor: str, rule: str) -> float | None:
    """A job that another launch of this sweep finished after this launch began (two launches
    of one sweep, e.g. a Slurm requeue while the first still runs): not run a second time.

    Args:
        work_dir: the job's work dir, whose result.json is read.
        monitor: the monitored metric's key.
        rule: the monitored metric's direction, used when result.json records no ``monitor_rule``.

    Returns:
        The job's best value (``best_value``) when its result.json was written after this launch began
            (``EXPKIT_SWEEP_LAUNCHED``) and says it finished; None otherwise (also outside a launch, and
            when result.json is missing or cannot be read).
    """
    launched, result_file = os.environ.get(SWEEP_LAUNCHED_ENV), work_dir / RESULT
    try:
        if launched is None or result_file.stat().st_mtime < float(launched):
            return None
    except (OSError, ValueError):
        return None
    result = read_result(work_dir)
    if result is None or not finished(result):
        return None
    log.info(
        "Job in %s was %s by another launch of this sweep; this launch does not run it again",
        work_dir,
        result.get("status"),
    )
    return best_value(result, monitor, rule)


def own_job_dir(job_dir: Path, hydra_dir: Path, command: str, owned: contextlib.ExitStack) -> bool:
    """Take `job_dir`'s lock into `owned`; False (the job skipped) when a live process of another
    launch holds it. In a job of several tasks (submitit) rank 0 takes it and decides for all.

    Args:
        job_dir: the dir whose lock is taken.
        hydra_dir: the dir Hydra gave the job, set back by ``skip_busy_job`` when the job is skipped.
        command: the command recorded in the lock.
        owned: the exit stack that holds the lock until the job ends.

    Returns:
        True when this process runs the job (rank 0 took the lock); False when a live process of another
            launch holds it.
    """
    from expkit.core import distributed
    from expkit.workdir.ownership import WorkDirBusy, WorkDirLock

    busy: WorkDirBusy | None = None
    if distributed.is_main():
        try:
            owned.enter_context(WorkDirLock(job_dir, command))
        except WorkDirBusy as exc:
            busy = exc
    if not distributed.broadcast_object(busy is not None):
        return True
    if busy is not None:
        skip_busy_job(hydra_dir, busy)
    return False


def skip_busy_job(hydra_dir: Path, busy: Any) -> None:
    """Another launch of this sweep runs this job right now: this launch skips it (the owner
    records it; waiting would hold this launch's workers idle). Hydra rewrote the dir's .hydra/
    for this launch: the owner's record goes back, and nothing is logged into its train.log.

    Args:
        hydra_dir: the dir Hydra gave the job: the ``.hydra`` files its job.json recorded are put back,
            and the root logger's file handlers writing into it are closed and removed.
        busy: the ``WorkDirBusy`` raised when taking the lock; its ``owner`` is named in the warning.
    """
    from expkit.workdir.ownership import describe

    job = read_job(hydra_dir)
    if job is not None and "hydra" in job:
        restore_hydra_record(hydra_dir, job)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == hydra_dir.resolve():
            root.removeHandler(handler)
            handler.close()
    log.warning(
        "Job in %s is running in another launch of this sweep (%s); this launch skips it, so it runs once",
        hydra_dir,
        describe(busy.owner),
    )


def may_start(sweep_dir: Path) -> bool:
    """Whether this sweep job may start: not once a signal stopped its launch. In a launcher's
    worker (joblib), Ctrl-C between runs is ignored: the launcher's process tells the
    workers through the sweep dir, and a worker's death would end the others' jobs unsaved.

    Args:
        sweep_dir: the job's sweep dir.

    Returns:
        False when a signal stopped the sweep (``stop_requested``), else True.
    """
    stopped = stop_requested(sweep_dir)
    if stopped is not None:
        log.info("Not started: %s stopped the sweep", signal.Signals(stopped).name)
        return False
    if not in_launching_process() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the run itself stops on it: stop_on_signals)
    return True


class Claim(NamedTuple):
    """What ``claim_job`` decided: the dir this process runs the job in, or the task's value."""

    work_dir: Path | None  # None: this process does not run the job
    value: float | None  # the value the task returns when it does not (None: no value)


def claim_job(
    cfg: DictConfig,
    hc: Any,
    overrides: list[str],
    monitored: tuple[str, str],
    run_info: dict[str, Any],
    owned: contextlib.ExitStack,
) -> Claim:
    """A sweep's bookkeeping before its job runs: whether this process runs it (its dir's lock
    then in `owned`), or else the value the task returns: a job done already gives its value, a
    job skipped by fail_fast the worst, a job that another launch runs or that a stopped sweep
    never starts None.

    Args:
        cfg: the job's config (``resume``, ``retry_failed``).
        hc: Hydra's config of the job (``HydraConfig.get()``): its sweep dir, output dir, number.
        overrides: the job's overrides (``expkit.train.task_overrides``): its identity in the sweep.
        monitored: the monitored metric and its direction (``monitor_of``).
        run_info: what the run records of its command; gets the sweep's name, the job's number,
            and ``resumed_in_sweep``.
        owned: gets the job dir's lock.

    Returns:
        ``Claim(work_dir, None)``: this process runs the job in ``work_dir`` (where ``resume=true``
            found it); ``Claim(None, value)``: it does not, and the task returns ``value``.
    """
    sweep_dir, work_dir, command = Path(hc.sweep.dir), Path(hc.runtime.output_dir), run_info["command"]
    _PLACED.pop(work_dir.resolve(), None)  # (an earlier launch's, in this process: not this job's)
    monitor, rule = monitored
    if not may_start(sweep_dir):
        return Claim(None, None)
    run_info["sweep_dir_name"] = sweep_dir.name  # wandb groups a sweep's jobs by it
    run_info["sweep_dir"] = str(sweep_dir.resolve())  # MLflow nests them under the sweep's parent run
    if os.environ.get(SWEEP_JOBS_ENV, "").isdigit():  # (job number, jobs of this launch)
        run_info["sweep_job"] = [int(hc.job.num), int(os.environ[SWEEP_JOBS_ENV])]
    # one writer per job dir: another launch of this sweep may be running this job now
    if not own_job_dir(work_dir, work_dir, command, owned):
        return Claim(None, None)
    job_dir = place_job(cfg, overrides, work_dir, sweep_dir)
    _PLACED[work_dir.resolve()] = job_dir
    if job_dir != work_dir and not own_job_dir(job_dir, work_dir, command, owned):
        return Claim(None, None)  # (resume=true found the job in another dir, which another launch runs)
    done = finished_job_value(cfg, job_dir, rule, monitor)
    if done is None:
        done = done_since_launch(job_dir, monitor, rule)
    if done is not None:
        return Claim(None, done)
    from expkit.checkpoint import checkpoint_io  # (here: it imports torch, which a sweep's summary needs not)

    if resuming_sweep(cfg) and any(
        checkpoint_io.is_checkpoint(p) for p in job_dir.glob("checkpoints/[!.]*") if p.suffix in (".pth", ".dcp")
    ):
        run_info["resumed_in_sweep"] = True
    if (sweep_dir / FAIL_FAST_MARKER).exists():
        earlier = (sweep_dir / FAIL_FAST_MARKER).read_text()
        write_failure(job_dir, f"an earlier job failed and fail_fast is set ({earlier})", status="skipped", keep=False)
        return Claim(None, worst_value(rule))
    return Claim(job_dir, None)
