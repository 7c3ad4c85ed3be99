"""Optuna searches, the job's side: which trial a sweep job is, and the hook that reports the
monitored metric to that trial after every validation and stops the job when the pruner says so.

The sweeper (``hydra_plugins.expkit_sweeper.optuna_sweeper``, ``hparams_search=optuna``) asks
the study for a trial, then launches a job with ``hydra.job.env_set`` naming the trial; Hydra
sets those variables around the job in whatever process runs it (this one, a joblib worker, a
Slurm task), so the job finds its trial through the study's storage (by default the sweep
dir's ``optuna.journal``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = [
    "JOURNAL_SUFFIXES",
    "OBJECTIVES",
    "PLACE",
    "STORAGE_WAIT_S",
    "TRIAL_ENV",
    "UNREACHABLE",
    "WORKERS",
    "StorageUnreachable",
    "TrialReportHook",
    "current_trial",
    "database_url",
    "job_env",
    "join_search",
    "live_workers",
    "objective_values",
    "objectives_of",
    "open_storage",
    "pareto_front",
    "shown_url",
    "with_storage",
]


log = logging.getLogger("expkit")

TRIAL_ENV = "EXPKIT_OPTUNA_TRIAL"  # "<trial id> <trial number>"

STORAGE_WAIT_S = 120.0  # how long an unreachable storage is waited for before the work stops
UNREACHABLE = "interrupted: the Optuna storage was unreachable"  # (a job's stop_reason begins so)

T = TypeVar("T")


class StorageUnreachable(Exception):
    """The study's storage did not answer for the whole wait (``with_storage``)."""


def _outage_types() -> tuple[type[BaseException], ...]:
    """The errors of a database that is down or restarting (not of a bad request): Optuna wraps
    a failed commit in StorageInternalError; a read, a connect or a dropped connection raise
    SQLAlchemy's OperationalError / InterfaceError (psycopg's, wrapped)."""
    import optuna
    from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError

    return optuna.exceptions.StorageInternalError, OperationalError, InterfaceError, DisconnectionError


def with_storage(what: str, call: Callable[[], T], wait_s: float = STORAGE_WAIT_S) -> T:
    """`call()`, tried again with backoff while the study's storage is unreachable (a database
    server restarting, a network blip), each retry logged; an outage longer than the wait
    raises ``StorageUnreachable``. Any other error is raised at once.

    Args:
        what: what the call does, for the log lines ("telling trial 3 its value").
        call: the storage operation; it must be safe to run again after an outage error (Optuna's
            are: a failed commit is rolled back).
        wait_s: the seconds to keep trying (``hydra.sweeper.storage_wait_s``).

    Returns:
        What `call` returned.

    Raises:
        StorageUnreachable: when `call` still failed with an outage error after `wait_s` seconds; its
            message says what was being done, for how long, and the last error.
    """
    import time

    outages = _outage_types()
    start, pause = time.monotonic(), 0.5
    while True:
        try:
            return call()
        except outages as exc:
            # the driver's own words (Optuna wraps SQLAlchemy's error, which wraps the driver's)
            cause = exc.__cause__ or exc
            cause = getattr(cause, "orig", None) or cause
            error = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise StorageUnreachable(
                    f"the Optuna storage did not answer for {waited:.0f} s while {what} ({error})"
                ) from None
            pause = min(pause, wait_s - waited)
            log.warning(
                "Optuna storage unreachable while %s (%s); trying again in %.1f s (%.0f of %.0f s waited)",
                what,
                error,
                pause,
                waited,
                wait_s,
            )
            time.sleep(pause)
            pause = min(pause * 2, 8.0)


JOURNAL_SUFFIXES = (".journal", ".log", ".jsonl")
WORKERS = ".workers"  # <sweep dir>/.workers/<host>-<pid>-<token>/.lock: one per worker of a search


OBJECTIVES = "objectives.json"  # <sweep dir>/objectives.json: a search's objectives and directions


def objective_values(result: dict[str, Any], objectives: Sequence[str]) -> list[float | None]:
    """A job's value of each objective: the metric's best value in result.json, else its final
    value, else a number result.json holds under that name (``model_params``, ``wall_time_s``).

    Args:
        result: the job's result.json.
        objectives: the objectives' keys.

    Returns:
        One float per objective; None where result.json holds no finite number for it.
    """
    best, final = result.get("best_metrics") or {}, result.get("final_metrics") or {}
    values: list[float | None] = []
    for key in objectives:
        found = best.get(key)
        value = found.get("value") if isinstance(found, dict) else None
        if value is None:
            value = final.get(key) if isinstance(final, dict) else None
        if value is None:
            value = result.get(key)
        usable = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        values.append(float(value) if usable else None)
    return values


def objectives_of(sweep_dir: Path) -> tuple[list[str], list[str]] | None:
    """A search's objectives and their directions, as its sweeper recorded them.

    Args:
        sweep_dir: the sweep dir, whose ``objectives.json`` is read.

    Returns:
        (objectives, directions); None for a sweep of one objective, or an unreadable record.
    """
    import json

    try:
        record = json.loads((Path(sweep_dir) / OBJECTIVES).read_text())
        names, directions = list(record["objectives"]), list(record["directions"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    ok = len(names) == len(directions) and all(isinstance(n, str) for n in names)
    return (names, directions) if ok and set(directions) <= {"maximize", "minimize"} else None


def pareto_front(points: list[list[float]], directions: list[str]) -> list[int]:
    """The indices of the points no other point dominates (at least as good in every objective,
    better in one), as Optuna's ``study.best_trials`` picks them.

    Args:
        points: each point's values, one per objective.
        directions: ``maximize`` or ``minimize`` per objective.

    Returns:
        The non-dominated points' indices, in order.
    """
    signs = [1.0 if d == "minimize" else -1.0 for d in directions]
    costs = [[s * v for s, v in zip(signs, point, strict=True)] for point in points]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and any(x < y for x, y in zip(a, b, strict=True))

    return [i for i, c in enumerate(costs) if not any(dominates(other, c) for other in costs)]


def live_workers(sweep_dir: Path) -> int:
    """How many workers of an Optuna search run in `sweep_dir` now (here, or on other hosts that
    share the dir): the sweeper's processes, each holding the lock of its dir under .workers/.

    Args:
        sweep_dir: the sweep directory.

    Returns:
        The number of entries under ``<sweep_dir>/.workers`` whose lock has a live owner; 0 when there
        is no such dir.
    """
    from expkit.workdir.ownership import live_owner

    workers = Path(sweep_dir) / WORKERS
    return sum(live_owner(d) is not None for d in workers.iterdir()) if workers.is_dir() else 0


PLACE = ".place-{}"  # <sweep dir>/.workers/.place-<k>: flocked by the worker in place k while it runs


def join_search(sweep_dir: Path, worker: str, command: str) -> tuple[contextlib.ExitStack, int]:
    """Make this process one more worker of the Optuna search in `sweep_dir`: take the lowest
    free place and the lock of its own dir under .workers/. The place seeds the worker's sampler
    apart from the others'. A place is the flock of ``.workers/.place-<k>``, held while the
    worker runs: two workers started at once cannot both take place 0 (counting the live
    workers raced: both counted none before either held its lock, seeded their samplers alike
    and drew the same trials), a worker alone always takes 0 (a resumed search seeds as before),
    and no directory listing is read (an NFS client may cache one).

    Args:
        sweep_dir: the sweep directory.
        worker: this worker's dir name under ``<sweep_dir>/.workers`` (unique: host, pid, token).
        command: the command recorded as the lock's owner.

    Returns:
        What this worker holds (closing it releases its lock, then its place) and its place: 0,
        1, ..., the lowest that no running worker holds. Where the file system has no flock, the
        number of live workers (0 for a worker alone; workers started at the same moment may
        then share a place).
    """
    import fcntl

    from expkit.workdir.ownership import WorkDirLock

    workers = Path(sweep_dir) / WORKERS
    workers.mkdir(parents=True, exist_ok=True)
    held = contextlib.ExitStack()
    try:
        place = None
        for k in range(1024):
            fd = os.open(workers / PLACE.format(k), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a running worker's place
                os.close(fd)
                continue
            except OSError:  # no flock here
                os.close(fd)
                break
            held.callback(os.close, fd)  # (closing drops the flock)
            place = k
            break
        if place is None:
            place = live_workers(sweep_dir)
        lock = WorkDirLock(workers / worker, command).acquire()
        held.callback(lock.release)
    except BaseException:
        held.close()
        raise
    return held, place


def open_storage(spec: str) -> Any:
    """An Optuna storage from the sweeper's ``storage`` setting: a database URL
    (``sqlite:///study.db``, ``postgresql://...``: Optuna's RDB storage) or a file path ending
    in .journal / .log / .jsonl (Optuna's journal file: no database server, fine on NFS).

    Args:
        spec: a database URL (anything with ``://``) or a journal file path; a journal file's
            directory is made when missing.

    Returns:
        Optuna's ``RDBStorage`` or ``JournalStorage``.

    Raises:
        ValueError: when `spec` is neither a URL nor a path ending in a journal suffix.
        sqlalchemy.exc.SQLAlchemyError: when the database refuses, other than a race of workers making
            its tables together, or that race still fails after six tries.
    """
    if "://" in spec:
        import time

        import optuna
        from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

        # a database server restarts under a long search: a pooled connection is checked before
        # use (one round trip) instead of failing its first statement, and a connect gives up in
        # 10 s (with_storage then waits); SQLite has no server to lose
        engine = {} if spec.startswith("sqlite") else {"pool_pre_ping": True}
        if spec.partition("://")[0].partition("+")[0] in ("postgresql", "postgres"):
            engine["connect_args"] = {"connect_timeout": 10}
        for attempt in range(6):
            try:
                return optuna.storages.RDBStorage(database_url(spec), engine_kwargs=engine)
            except (IntegrityError, ProgrammingError, OperationalError) as exc:
                # workers started together all create the tables (PostgreSQL: a unique violation;
                # SQLite: "table ... already exists", "database is locked"): the first one wins
                racing = not isinstance(exc, OperationalError) or any(
                    s in str(exc) for s in ("already exists", "database is locked")
                )
                if not racing or attempt == 5:
                    raise
                time.sleep(0.2 * (attempt + 1))
    if spec.endswith(JOURNAL_SUFFIXES):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        Path(spec).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(spec))
    raise ValueError(
        f"storage={spec!r}: give a database URL (sqlite:///study.db) or a journal file "
        f"(a path ending in {', '.join(JOURNAL_SUFFIXES)})"
    )


def database_url(spec: str) -> str:
    """A database URL as SQLAlchemy takes it: ``postgresql://`` goes through psycopg (3, the
    postgres extra) when psycopg2, SQLAlchemy's default driver for it, is not installed.

    Args:
        spec: a database URL.

    Returns:
        `spec` with its scheme replaced by ``postgresql+psycopg`` when it is ``postgresql`` or
        ``postgres``, psycopg2 is missing and psycopg is installed; else `spec` unchanged.
    """
    import importlib.util

    scheme, _, rest = spec.partition("://")
    if (
        scheme in ("postgresql", "postgres")
        and importlib.util.find_spec("psycopg2") is None
        and importlib.util.find_spec("psycopg") is not None
    ):
        return f"postgresql+psycopg://{rest}"
    return spec


def shown_url(spec: str) -> str:
    """`spec` for a message: a database URL without its password.

    Args:
        spec: a storage setting: a database URL or a file path.

    Returns:
        The URL with its password masked (``***``); `spec` unchanged when it is not a URL or SQLAlchemy
        cannot parse it.
    """
    if "://" not in spec:
        return spec
    try:
        from sqlalchemy.engine import make_url

        return make_url(spec).render_as_string(hide_password=True)
    except Exception:
        return spec


def job_env(trial: Any) -> str:
    """The override that tells a launched job its trial (Hydra sets it as an environment variable
    around the job, in whatever process runs it); the job finds the study and its storage in
    its own Hydra config (``hydra.sweeper``).

    Args:
        trial: the Optuna trial the job runs (its id and number are read).

    Returns:
        ``+hydra.job.env_set.EXPKIT_OPTUNA_TRIAL='<trial id> <trial number>'``.
    """
    return f"+hydra.job.env_set.{TRIAL_ENV}='{trial._trial_id} {trial.number}'"


def current_trial() -> tuple[Any, int, float] | None:
    """(optuna.Trial, trial number, storage wait) of this sweep job, or None outside an Optuna search.

    Returns:
        The trial, loaded from the storage of the job's ``hydra.sweeper`` settings (with the sweeper's
        pruner), its number and the seconds an unreachable storage is waited for
        (``hydra.sweeper.storage_wait_s``); None when ``EXPKIT_OPTUNA_TRIAL`` is unset or empty.

    Raises:
        StorageUnreachable: when the storage does not answer for that long.
    """
    spec = os.environ.get(TRIAL_ENV)
    if not spec:
        return None
    import optuna
    from hydra.core.hydra_config import HydraConfig

    from expkit.core.hydra_compat import instantiate

    trial_id, number = (int(x) for x in spec.split())
    hydra = HydraConfig.get()
    sweeper = hydra.sweeper
    name = sweeper.get("study_name") or "expkit"
    storage = sweeper.get("storage") or str(Path(hydra.sweep.dir) / "optuna.journal")  # (the sweeper's rule)
    wait_s = float(sweeper.get("storage_wait_s", STORAGE_WAIT_S))
    # a study loaded from storage does not carry its pruner: the sweeper's is built here too
    pruner = instantiate(sweeper.pruner) if sweeper.get("pruner") else optuna.pruners.NopPruner()
    study = with_storage(
        f"loading study {name!r} for trial {number}",
        lambda: optuna.load_study(study_name=name, storage=open_storage(storage), pruner=pruner),
        wait_s,
    )
    return optuna.trial.Trial(study, trial_id), number, wait_s


class TrialReportHook(Hook):
    """Reports ``monitor`` to the Optuna trial after every validation, at the run's step
    (``runner.iter``, the one step axis of metrics.jsonl), and stops the run when the study's
    pruner prunes it: the current epoch's checkpoint stays, the test pass is skipped, and
    result.json says ``pruned``. Registered by ``expkit.train`` for jobs of an Optuna search.

    Args:
        trial: the job's ``optuna.Trial`` (``current_trial``'s), with the study's pruner; the main process
            reports to it.
        number: the trial's number in the study, kept as ``number`` (for messages).
        wait_s: how long an unreachable storage is tried again before the job stops, resumable
            (``stopped``, ``stop_reason`` beginning ``interrupted``).
    """

    priority = "LOWEST"  # after the checkpoint hook has saved this validation's files

    def __init__(self, trial: Any, number: int, wait_s: float = STORAGE_WAIT_S) -> None:
        self.trial, self.number, self.wait_s = trial, number, wait_s
        # a study of several objectives takes no intermediate values (Optuna cannot prune it)
        self.reports = len(trial.study.directions) == 1

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        from expkit.core import distributed

        if not self.reports:
            return
        value = metrics.get(runner.monitor) if runner.monitor else None
        verdict: str | None = None  # None: go on; else "prune", or why the storage stops the job
        if runner.is_main and isinstance(value, (int, float)) and math.isfinite(value):  # (diverged: not reported)
            try:
                verdict = with_storage(
                    f"reporting step {runner.iter} of trial {self.number}",
                    self._report(value, runner.iter),
                    self.wait_s,
                )
            except StorageUnreachable as exc:
                # the validation's checkpoint is saved (this hook runs last): the job stops as a
                # signal stops it, resumable, and its worker stops too (resume=true goes on)
                verdict = f"{UNREACHABLE}: {exc}"
        verdict = distributed.broadcast_object(verdict)  # rank 0 decides for every rank of a multi-task job
        if verdict == "prune":
            pruner = type(self.trial.study.pruner).__name__
            runner.request_stop(
                f"pruned by {pruner} at step {runner.iter} ({runner.monitor}={value:.4f})", status="pruned"
            )
        elif verdict is not None:
            runner.request_stop(verdict, resumable=True)

    def _report(self, value: float, step: int) -> Callable[[], str | None]:
        def report() -> str | None:
            self.trial.report(float(value), step=step)  # (again after an outage: Optuna keeps a step's first value)
            return "prune" if self.trial.should_prune() else None

        return report
