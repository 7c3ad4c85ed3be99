"""Optuna searches, the job's side: which trial a sweep job is, and the hook that reports the
monitored metric to that trial after every validation and stops the job when the pruner says so.

The sweeper (``hydra_plugins.expkit_sweeper.optuna_sweeper``, ``hparams_search=optuna``) asks
the study for a trial, then launches a job with ``hydra.job.env_set`` naming the trial; Hydra
sets those variables around the job in whatever process runs it (this one, a joblib worker, a
Slurm task), so the job finds its trial through the study's storage (by default the sweep
dir's ``optuna.journal``).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = [
    "JOURNAL_SUFFIXES",
    "STORAGE_ENV",
    "STUDY_ENV",
    "TRIAL_ENV",
    "WORKERS",
    "TrialReportHook",
    "current_trial",
    "database_url",
    "job_env",
    "live_workers",
    "open_storage",
    "shown_url",
]


log = logging.getLogger("expkit")

TRIAL_ENV = "EXPKIT_OPTUNA_TRIAL"  # "<trial id> <trial number>"
STUDY_ENV = "EXPKIT_OPTUNA_STUDY"
STORAGE_ENV = "EXPKIT_OPTUNA_STORAGE"

JOURNAL_SUFFIXES = (".journal", ".log", ".jsonl")
WORKERS = ".workers"  # <sweep dir>/.workers/<host>-<pid>-<token>/.lock: one per worker of a search


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

        for attempt in range(6):
            try:
                return optuna.storages.RDBStorage(database_url(spec))
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


def job_env(trial: Any, study_name: str, storage: str) -> list[str]:
    """The overrides that tell a launched job its trial (Hydra sets them as environment variables).

    Args:
        trial: the Optuna trial the job runs (its id and number are read).
        study_name: the study's name.
        storage: the storage setting, as ``open_storage`` takes it.

    Returns:
        Three ``+hydra.job.env_set.<VAR>='<value>'`` overrides: the trial, the study and the storage.
    """
    values = {TRIAL_ENV: f"{trial._trial_id} {trial.number}", STUDY_ENV: study_name, STORAGE_ENV: storage}
    return [f"+hydra.job.env_set.{k}='{v}'" for k, v in values.items()]


def current_trial() -> tuple[Any, int] | None:
    """(optuna.Trial, trial number) of this sweep job, or None outside an Optuna search.

    Returns:
        The trial, loaded from the storage the environment names (with the sweeper's pruner), and
        its number; None when ``EXPKIT_OPTUNA_TRIAL`` is unset or empty.
    """
    spec = os.environ.get(TRIAL_ENV)
    if not spec:
        return None
    import optuna

    trial_id, number = (int(x) for x in spec.split())
    name, storage = os.environ.get(STUDY_ENV, ""), os.environ.get(STORAGE_ENV, "")
    study = optuna.load_study(study_name=name, storage=open_storage(storage), pruner=_sweeper_pruner())
    return optuna.trial.Trial(study, trial_id), number


def _sweeper_pruner() -> Any:
    """The pruner the sweeper was given (``hydra.sweeper.pruner``: the job's Hydra config holds
    it), built in this job; a study loaded from storage does not carry its pruner."""
    import optuna
    from hydra.core.hydra_config import HydraConfig

    from expkit.core.hydra_compat import instantiate

    spec = HydraConfig.get().sweeper.get("pruner") if HydraConfig.initialized() else None
    return instantiate(spec) if spec else optuna.pruners.NopPruner()


class TrialReportHook(Hook):
    """Reports ``monitor`` to the Optuna trial after every validation, at the run's step
    (``runner.iter``, the one step axis of metrics.jsonl), and stops the run when the study's
    pruner prunes it: the current epoch's checkpoint stays, the test pass is skipped, and
    result.json says ``pruned``. Registered by ``expkit.train`` for jobs of an Optuna search.

    Args:
        trial: the job's ``optuna.Trial`` (``current_trial``'s), with the study's pruner; the main process
            reports to it.
        number: the trial's number in the study, kept as ``number`` (the hook itself does not use it).
    """

    priority = "LOWEST"  # after the checkpoint hook has saved this validation's files

    def __init__(self, trial: Any, number: int) -> None:
        self.trial, self.number = trial, number

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        from expkit.core import distributed

        value = metrics.get(runner.monitor) if runner.monitor else None
        prune = False
        if runner.is_main and isinstance(value, (int, float)) and math.isfinite(value):  # (diverged: not reported)
            self.trial.report(float(value), step=runner.iter)
            prune = self.trial.should_prune()
        if distributed.broadcast_object(prune):  # rank 0 decides for every rank of a multi-task job
            pruner = type(self.trial.study.pruner).__name__
            runner.request_stop(
                f"pruned by {pruner} at step {runner.iter} ({runner.monitor}={value:.4f})", status="pruned"
            )
