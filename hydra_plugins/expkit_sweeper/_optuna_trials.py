"""The Optuna sweeper's trials in slots: each slot asks for a trial when it is free (or takes
over one a gone worker left running), launches its jobs (one per seed) and tells the study
how they ended; several workers share one sweep dir through its ledger."""

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from expkit.sweeps.search import TRIAL_ENV, job_env, with_storage
from hydra_plugins.expkit_sweeper._optuna_ledger import LEDGER, Ledger, trial_alive, worker_alive
from hydra_plugins.expkit_sweeper._optuna_settings import SearchConfigError

__all__ = ["WAIT", "WAIT_S", "TrialSlots", "launch_lines_without_the_trial"]


log = logging.getLogger("expkit")

WAIT = "wait"  # (take(): other workers' trials still run)
WAIT_S = 2.0

# the override that tells a job its trial (search.job_env): the job's own, not the user's
_TRIAL_OVERRIDE = re.compile(rf" ?\+hydra\.job\.env_set\.{TRIAL_ENV}='[^']*'")


@contextlib.contextmanager
def launch_lines_without_the_trial(launcher_module: str) -> Iterator[None]:
    """Inside, the lines a launcher logs for its jobs (``#3 : optim.lr=0.01 ...``) leave out the
    trial override: the job still gets it; the line shows what the user searches.

    A launcher logs them from its own package's modules (Hydra's basic launcher, joblib's
    ``_core``, imported at its first launch, submitit's launcher): the records of that package's
    loggers are mended as they are made (logging's record factory, put back after).

    Args:
        launcher_module: the module of the launcher's class (not of a wrapper of it).

    Yields:
        Nothing: the search runs inside.
    """
    package = launcher_module.rpartition(".")[0] or launcher_module
    made = logging.getLogRecordFactory()

    def mended(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = made(*args, **kwargs)
        if (record.name == package or record.name.startswith(package + ".")) and TRIAL_ENV in str(record.msg):
            record.msg, record.args = _TRIAL_OVERRIDE.sub("", record.getMessage()), ()
        return record

    logging.setLogRecordFactory(mended)
    try:
        yield
    finally:
        if logging.getLogRecordFactory() is mended:
            logging.setLogRecordFactory(made)


class TrialSlots:
    """The trial-running part of ``OptunaSweeper``: slots that take trials, launch their jobs and
    tell the study, until the sweep dir holds its trials."""

    config: DictConfig | None
    launcher: Any
    study_name: str
    n_trials: int
    n_jobs: int
    seeds_per_trial: int
    storage_wait_s: float
    in_process: bool
    checked: set[tuple[str, str]] | None
    worker: str
    exhausted: bool

    def _search(
        self,
        study: Any,
        sweep_dir: Path,
        storage: str,
        fixed: list[str],
        space: dict[str, Any],
        sampler: Any,
        pruner: Any,
        direction: str,
    ) -> None:
        from optuna.trial import TrialState

        from expkit.sweeps.sweep_jobs import stop_requested

        assert self.config is not None
        ledger = Ledger(sweep_dir / LEDGER)
        log.info(
            "Optuna study %s (%s, %s): %d trials, %d at once; sampler %s, pruner %s",
            self.study_name,
            storage,
            direction,
            self.n_trials,
            self.n_jobs,
            type(sampler).__name__,
            type(pruner).__name__,
        )
        seeds = self._seeds(fixed)
        lock = threading.Lock()  # this process's asks and tells
        total = self._join(ledger, sweep_dir) + self.n_trials  # the trials the sweep dir holds when done

        def take() -> tuple[Any, list[list[str]], int] | str | None:
            """The next trial for a free slot, its jobs and the first job's number: a trial a gone
            worker left running (resumed from its checkpoint), else a new one (asked now); WAIT
            while the sweep dir has its trials but other workers' trials still run (one may die);
            None when every trial is done, or a signal stopped this worker."""
            with lock, ledger.locked():
                if stop_requested(sweep_dir) is not None:
                    return None
                trials = with_storage(
                    "reading the study's running trials",
                    lambda: study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)),
                    self.storage_wait_s,
                )
                running = {t.number for t in trials}
                for number, entry in sorted(ledger.trials.items(), key=lambda kv: int(kv[0])):
                    if (
                        int(number) in running
                        and entry.get("worker") != self.worker
                        and not trial_alive(sweep_dir, entry)
                    ):
                        return self._take_over(study, ledger, storage, entry, number)
                if len(ledger.trials) < total and not self.exhausted:
                    trial = with_storage(
                        "asking for a new trial", lambda: study.ask(fixed_distributions=space), self.storage_wait_s
                    )
                    jobs = [
                        [
                            *fixed,
                            *self._overrides(trial, space),
                            *seed,
                            job_env(trial),
                        ]
                        for seed in seeds
                    ]
                    first = trial.number * len(seeds)  # job dirs named by the study's trial number
                    self._add(ledger, trial, jobs, first)
                    return trial, jobs, first
                others = [n for n, e in ledger.trials.items() if int(n) in running and e.get("worker") != self.worker]
                return WAIT if others else None

        slots = 1 if self.in_process else self.n_jobs
        if slots <= 1:  # in this thread (the in-process launcher's jobs take the signals themselves)
            self._slot(take, self.launcher.launch, study, ledger, lock, sweep_dir)
        else:  # no batch barrier: each slot asks for its next trial as soon as its last one ended
            self.launcher.guarded(lambda: self._in_slots(slots, take, study, ledger, lock, sweep_dir))
        self._write_results(study, sweep_dir)

    def _join(self, ledger: Ledger, sweep_dir: Path) -> int:
        """Join the launch of this sweep dir whose workers still run, or begin a new one; the
        number of trials the sweep dir held when it began. ``n_trials`` counts from there: a
        new launch runs ``n_trials`` more (as Hydra's sweepers run a sweep again), and
        ``resume=true`` begins from none (the sweep dir ends up holding ``n_trials``)."""
        assert self.config is not None
        with ledger.locked():
            launch = ledger.launch
            members = [m for m in launch.get("members") or [] if isinstance(m, str)]
            if any(m != self.worker and worker_alive(sweep_dir, m) for m in members):
                launch["members"] = [*members, self.worker]  # (workers started together, or joining)
            else:
                base = 0 if self.config.get("resume") else len(ledger.trials)
                ledger.launch = launch = {"base": base, "members": [self.worker]}
            ledger.save()
        base = launch.get("base")
        return base if isinstance(base, int) and base >= 0 else 0

    def _take_over(
        self, study: Any, ledger: Ledger, storage: str, entry: dict[str, Any], number: str
    ) -> tuple[Any, list[list[str]], int]:
        """A trial whose worker is gone (killed, or stopped by a signal) with the trial left
        running: this worker runs its jobs again in their own dirs (each resumes from its
        checkpoint, or returns its result if it had finished) and tells the study."""
        import optuna

        trial = with_storage(
            f"taking over trial {number}", lambda: optuna.trial.Trial(study, entry["trial_id"]), self.storage_wait_s
        )
        jobs = []
        for overrides in entry.get("seed_overrides") or [entry["overrides"]]:
            # (the ledger of an earlier expkit holds +hydra.job.env_set.VAR=... overrides)
            job = [o for o in overrides if not o.startswith(("+hydra.job.env_set.", "hydra.job.env_set="))]
            job.append(job_env(trial))
            jobs.append(job if "resume=true" in job else [*job, "resume=true"])
        log.info(
            "Optuna: trial %s was left running by %s; resuming it in job %s",
            number,
            entry.get("worker", "an earlier launch"),
            entry["job"],
        )
        self._add(ledger, trial, jobs, int(entry["job"]))
        return trial, jobs, int(entry["job"])

    def _wait(self, sweep_dir: Path) -> None:
        """Other workers run the last trials: wait a little (a signal for this worker ends it)."""
        from expkit.sweeps.sweep_jobs import stop_requested

        deadline = time.time() + WAIT_S
        while time.time() < deadline and stop_requested(sweep_dir) is None:
            time.sleep(0.2)

    def _in_slots(
        self, slots: int, take: Any, study: Any, ledger: Ledger, lock: threading.Lock, sweep_dir: Path
    ) -> None:
        """`slots` threads, each launching one trial at a time (its jobs run in the launcher's
        workers: joblib processes, submitit jobs) and telling the study how it ended. The first
        error stops every slot from taking another trial and is raised here once all returned."""
        errors: list[BaseException] = []

        def slot() -> None:
            try:
                self._slot(take, self.launcher.launch_unguarded, study, ledger, lock, sweep_dir, errors)
            except BaseException as exc:  # (re-raised in the main thread)
                errors.append(exc)

        threads = [threading.Thread(target=slot, name=f"expkit-optuna-slot-{i}", daemon=True) for i in range(slots)]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # (a timeout: this thread's signal handlers run while it waits)
                thread.join(0.2)
        if errors:
            raise errors[0]

    def _slot(
        self,
        take: Any,
        launch: Any,
        study: Any,
        ledger: Ledger,
        lock: threading.Lock,
        sweep_dir: Path,
        errors: Sequence[BaseException] = (),
    ) -> None:
        """One slot: take a trial, launch its jobs, tell the study; until none is left (or
        another slot failed: `errors`)."""
        while not errors and (taken := take()) is not None:
            if taken == WAIT:
                self._wait(sweep_dir)
                continue
            trial, jobs, first = taken
            returns = launch(jobs, initial_job_idx=first)
            with lock:
                self._tell(study, ledger, trial, returns)

    def _seeds(self, fixed: list[str]) -> list[list[str]]:
        """Each trial's seed overrides: [[]] for one seed; else `seeds_per_trial` values of the
        first ``seed_keys`` key, from its configured value (0, 1, 2 for trainer.seed=0)."""
        if self.seeds_per_trial == 1:
            return [[]]
        assert self.config is not None
        key = str((self.config.get("seed_keys") or ["trainer.seed"])[0])
        if any(f.lstrip("+").partition("=")[0] == key for f in fixed):
            raise SearchConfigError(
                f"hydra.sweeper.seeds_per_trial={self.seeds_per_trial} sets {key} itself; "
                f"leave {key} out of the command line and the search space"
            )
        base = OmegaConf.select(self.config, key)
        if isinstance(base, bool) or not isinstance(base, int):
            raise SearchConfigError(
                f"hydra.sweeper.seeds_per_trial: {key} (the first of seed_keys) is {base!r}, "
                "not a whole number to count seeds from"
            )
        return [[f"{key}={base + i}"] for i in range(self.seeds_per_trial)]

    def _add(self, ledger: Ledger, trial: Any, jobs: list[list[str]], first: int) -> None:
        """Record `trial` (its jobs, one per seed, numbered from `first`) as this worker's in the
        ledger, after composing its jobs: a bad override fails before anything trains. A job
        composed in another process (joblib, submitit) is composed here only while it brings
        something new (the first trial, a choice not seen yet): the rest of a search differs in
        numbers alone, and composing each costs ~0.1 s between one trial and the next."""
        ledger.add(trial, jobs, first, self.worker)
        from optuna.distributions import CategoricalDistribution

        choices = {
            (k, repr(v))
            for k, v in trial.params.items()
            if isinstance(trial.distributions.get(k), CategoricalDistribution)
        }
        if self.in_process or self.checked is None or not choices <= self.checked:
            self.validate_batch_is_legal(jobs)  # (in this process: the launch then uses the composed config)
            self.checked = (self.checked or set()) | choices
