"""The Optuna sweeper's records in the sweep dir: ``optuna_trials.json`` (each trial's job dir,
overrides, worker and status, shared by the workers under a lock), whether a trial's worker or
jobs still run, and ``.search.json`` (the one study a sweep dir's trials belong to)."""

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from expkit.sweeps.search import WORKERS
from hydra_plugins.expkit_sweeper._optuna_settings import SearchConfigError

__all__ = ["BINDING", "LEDGER", "Ledger", "bind_sweep_dir", "trial_alive", "worker_alive"]


LEDGER = "optuna_trials.json"
BINDING = ".search.json"  # <sweep dir>/.search.json: the study this sweep dir's trials belong to


class Ledger:
    """``optuna_trials.json``: this sweep dir's trials (number -> trial id, job dir, overrides,
    the worker running it, status), written after every ask and every tell. Several workers
    share it: each change is made under an exclusive ``flock`` of ``.optuna_trials.lock``
    (NFS clients honour it across hosts), on the file as it is then.

    Args:
        path: the ledger file, ``<sweep dir>/optuna_trials.json``, read now (missing or unreadable: no
            trials yet); the lock file ``.optuna_trials.lock`` is made beside it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.trials: dict[str, dict[str, Any]] = {}
        self.launch: dict[str, Any] = {}  # the workers of this launch, and the trials held when it began
        self._read()

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        self.trials = data["trials"] if isinstance(data.get("trials"), dict) else {}
        self.launch = data["launch"] if isinstance(data.get("launch"), dict) else {}

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Inside: no other worker changes the ledger; ``trials`` is read afresh."""
        import fcntl

        fd = os.open(self.path.with_name(".optuna_trials.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with contextlib.suppress(OSError):  # (a filesystem without locks: one worker per sweep dir)
                fcntl.flock(fd, fcntl.LOCK_EX)
            self._read()
            yield
        finally:
            os.close(fd)  # (drops the lock)

    def add(self, trial: Any, jobs: list[list[str]], first: int, worker: str) -> None:
        """The trial's jobs (one per seed), numbered from `first`, run by `worker` (inside ``locked``)."""
        entry = {
            "trial_id": trial._trial_id,
            "job": str(first),
            "overrides": jobs[0],
            "status": "running",
            "worker": worker,
        }
        if len(jobs) > 1:
            entry.update(jobs=[str(first + i) for i in range(len(jobs))], seed_overrides=jobs)
        self.trials[str(trial.number)] = entry
        self.save()

    def finish(self, trial: Any, status: str) -> None:
        with self.locked():
            self.trials[str(trial.number)]["status"] = status
            self.save()

    def save(self) -> None:
        """(Inside ``locked``.)"""
        from expkit.core.atomic import write_json_atomic

        write_json_atomic(self.path, {"trials": self.trials, "launch": self.launch})


def trial_alive(sweep_dir: Path, entry: dict[str, Any]) -> bool:
    """Whether a ledger entry's trial is still in hand: its worker runs (holds its lock), or one
    of its jobs does (a submitit job outlives the worker that launched it).

    Args:
        sweep_dir: the sweep dir.
        entry: the trial's entry in the ledger.

    Returns:
        True when its worker or one of its jobs holds its lock.
    """
    from expkit.core.confine import confined
    from expkit.workdir.ownership import live_owner

    if worker_alive(sweep_dir, entry.get("worker")):
        return True
    jobs = [
        confined(sweep_dir, job, sweep_dir / LEDGER, "job dir")
        for job in entry.get("jobs") or [entry.get("job")]
        if job
    ]
    return any(job is not None and live_owner(job) is not None for job in jobs)


def worker_alive(sweep_dir: Path, worker: Any) -> bool:
    """Whether the worker of that name (read from the ledger) still runs: it holds its dir's lock.

    Args:
        sweep_dir: the sweep dir.
        worker: the worker's name under ``<sweep dir>/.workers/``, as the ledger holds it.

    Returns:
        True when the worker holds its lock; False for a name that is not a string or leaves the dir.
    """
    from expkit.core.confine import confined
    from expkit.workdir.ownership import live_owner

    where = confined(sweep_dir / WORKERS, worker, sweep_dir / LEDGER, "worker dir") if isinstance(worker, str) else None
    return where is not None and live_owner(where) is not None


def _own_storage(storage: Any, sweep_dir: Path) -> Any:
    """`storage` as the binding compares it: None for the sweep dir's own journal, a journal file
    by its absolute path (a relative and an absolute spelling of one file are one storage: the
    resume command a search prints gives the dir absolute), a URL as it is."""
    if not isinstance(storage, str) or "://" in storage:
        return storage
    path = os.path.realpath(storage)
    return None if path == os.path.realpath(sweep_dir / "optuna.journal") else path


def bind_sweep_dir(sweep_dir: Path, storage: str | None, study_name: str) -> None:
    """A sweep dir holds the trials of one study: the first worker records which; a command
    aimed at it with another study or storage stops (exit 2) before it asks for a trial.

    Args:
        sweep_dir: the sweep dir; the binding is ``<sweep_dir>/.search.json``, written once (by a hard
            link, so the first worker wins) with `study_name` and `storage`.
        storage: the study's storage, as the sweep opens it (the default journal's path when none was
            given); a journal file is compared by its absolute path, a URL as text.
        study_name: the study's name in its storage.

    Raises:
        SearchConfigError: when the recorded study name or storage differs from `study_name` and
            `storage` (a binding that cannot be read or parsed counts as the same).
    """
    mine = {"study_name": study_name, "storage": _own_storage(storage, sweep_dir)}
    path = sweep_dir / BINDING
    if not path.exists():
        tmp = path.with_name(f".{BINDING}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(mine))
        with contextlib.suppress(FileExistsError):  # (another worker recorded it first: compared below)
            os.link(tmp, path)
        tmp.unlink()
    try:
        theirs = json.loads(path.read_text())
        theirs["storage"] = _own_storage(theirs.get("storage"), sweep_dir)  # (as an earlier version wrote it)
    except (OSError, ValueError, TypeError, AttributeError):
        theirs = mine
    if theirs != mine:
        where = lambda b: f"study {b.get('study_name')!r} in {b.get('storage') or 'the sweep dir'}"
        raise SearchConfigError(
            f"hydra.sweep.dir={sweep_dir} holds the trials of {where(theirs)}; this command "
            f"searches {where(mine)}. Give another hydra.sweep.dir, or the same "
            "hydra.sweeper.study_name and storage to join that search"
        )
