"""expkit's Optuna sweeper (``hydra/sweeper=optuna``, picked by ``hparams_search=optuna``), on
current Optuna (>= 4), with the settings hydra-optuna-sweeper users know: ``direction``,
``study_name``, ``storage``, ``n_trials``, ``n_jobs``, ``sampler``, ``params`` and
``custom_search_space``, plus ``pruner``.

Each round asks the study for ``n_jobs`` trials, launches one job per trial through the
configured launcher (basic, joblib, submitit...), and tells the study how each ended:
its returned value (the best ``monitor`` of the run), ``pruned`` (the job's
``TrialReportHook`` stopped it on the pruner's word) or ``failed``. Jobs learn their
trial through ``hydra.job.env_set`` and reach the study through its storage, so pruning
works in any process. ``<sweep dir>/optuna_trials.json`` maps each trial of this sweep to
its job dir; ``resume=true`` runs again the trials a dead sweep left running (each resumes
from its checkpoint) and then the trials still missing from ``n_trials``.

Optuna is imported when the sweep starts, not when Hydra scans plugins (every command pays
for a scan).
"""

import importlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.expkit_sweeper.expkit_sweeper import (
    SweepConfigError,
    check_batch,
    check_seed_keys,
    compose_once,
    stoppable,
)

log = logging.getLogger("expkit")

LEDGER = "optuna_trials.json"


class SearchConfigError(SweepConfigError):
    """Bad sweeper settings: Hydra prints the message alone (no traceback) and expkit exits 2."""


@dataclass
class OptunaSweeperConf:  # OmegaConf reads these annotations at run time (hence Optional)
    _target_: str = "hydra_plugins.expkit_sweeper.optuna_sweeper.OptunaSweeper"
    direction: str | None = None  # maximize | minimize; null: from `monitor`, by expkit's one "better" rule
    study_name: str | None = "expkit"
    storage: str | None = (
        None  # null: <sweep dir>/optuna.journal; sqlite:///study.db; a .journal file; postgresql://...
    )
    n_trials: int = 20  # trials this command runs (resume=true: until the sweep dir holds this many)
    n_jobs: int = 1  # trials at once (with a parallel launcher: joblib, submitit)
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    pruner: Any = None  # {_target_: optuna.pruners.MedianPruner, ...}; null: no pruning
    params: dict[str, Any] | None = None  # name -> interval(..), tag(log, interval(..)), choice(..), range(..)
    custom_search_space: str | None = None  # "module.function": function(cfg, trial) suggests more
    seeds_per_trial: int = 1  # N: each trial runs N jobs (seeds from seed_keys[0]); the study gets their mean


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="expkit")


def distribution(value: Any) -> Any:
    """The Optuna distribution of a Hydra sweep value: interval (``tag(log, ...)`` for a log
    scale, ``tag(int, ...)`` for integers), range (Hydra's: the stop is excluded) or choice."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        count = math.ceil((stop - start) / step)
        if count < 1:
            raise ValueError(f"range({start}, {stop}, {step}) holds no value")
        last = start + step * (count - 1)
        if all(isinstance(x, int) for x in (start, stop, step)):
            return IntDistribution(min(start, last), max(start, last), step=abs(step))
        return FloatDistribution(float(min(start, last)), float(max(start, last)), step=abs(float(step)))
    if isinstance(value, ChoiceSweep):
        primitive = (type(None), bool, int, float, str)
        return CategoricalDistribution([v if isinstance(v, primitive) else Override._get_value_element_as_str(v)
                                        for v in value.list])  # fmt: skip
    raise ValueError(f"{value!r} is not interval(...), range(...) or choice(...)")


def override_value(value: Any) -> str:
    from hydra.core.override_parser.types import Override

    if isinstance(value, str) and value[:1] in "[{":  # a list or dict choice, kept as its override text
        return value
    return Override._get_value_element_as_str(value)


class OptunaSweeper(Sweeper):
    def __init__(self, direction: str | None = None, study_name: str | None = "expkit", storage: str | None = None,
                 n_trials: int = 20, n_jobs: int = 1, sampler: Any = None, pruner: Any = None,
                 params: dict[str, Any] | None = None, custom_search_space: str | None = None,
                 seeds_per_trial: int = 1) -> None:  # fmt: skip
        if direction not in (None, "maximize", "minimize"):
            raise SearchConfigError(f"hydra.sweeper.direction={direction}: use maximize, minimize, or null "
                                    "(from monitor)")  # fmt: skip
        for key, number in (("n_trials", n_trials), ("n_jobs", n_jobs), ("seeds_per_trial", seeds_per_trial)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise SearchConfigError(f"hydra.sweeper.{key}={number}: a whole number >= 1")
        self.direction, self.study_name, self.storage = direction, study_name or "expkit", storage
        self.n_trials, self.n_jobs, self.seeds_per_trial = n_trials, n_jobs, seeds_per_trial
        self.sampler_cfg, self.pruner_cfg = sampler, pruner
        self.params, self.custom_search_space = dict(params or {}), custom_search_space
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None
        self.in_process = False

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from expkit.hydra_compat import basic_launcher

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.in_process = type(self.launcher) is basic_launcher()
        if self.in_process:
            self.hydra_context = compose_once(self.launcher, hydra_context)
        self.launcher = stoppable(self.launcher, config)

    # -- the search space --------------------------------------------------------------------
    def _space(self, arguments: list[str]) -> tuple[list[str], dict[str, Any]]:
        """Fixed overrides and the search space, from ``params`` then the command line (wins)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        fixed: dict[str, str] = {}
        space: dict[str, Any] = {}
        for override in parser.parse_overrides(lines):
            key = override.get_key_element()
            fixed.pop(key, None)
            space.pop(key, None)
            if override.is_sweep_override():
                try:
                    space[key] = distribution(override.value())
                except ValueError as exc:
                    raise SearchConfigError(f"hydra.sweeper.params.{key}={override.input_line.partition('=')[2]}: "
                                            f"{exc}") from None  # fmt: skip
            else:
                fixed[key] = override.input_line
        return list(fixed.values()), space

    def _direction(self) -> str:
        """`direction`, else the run's own rule for `monitor`: its metric's setting or the metric
        object's ``higher_is_better`` (torchmetrics' MeanSquaredError: less), then the name."""
        if self.direction is not None:
            return self.direction
        from expkit.build import build_metrics
        from expkit.metrics import Directions
        from expkit.sweep import monitor_of

        assert self.config is not None
        monitor, rule = monitor_of(OmegaConf.to_container(self.config, resolve=False))  # type: ignore[arg-type]
        try:
            rule = Directions(build_metrics(self.config.get("metrics"))).rule(monitor) or rule
        except Exception as exc:
            log.warning("Optuna: could not build the metrics to read %s's direction (%s); using %s", monitor, exc, rule)
        return "maximize" if rule == "greater" else "minimize"

    # -- the sweep -------------------------------------------------------------------------------
    def sweep(self, arguments: list[str]) -> None:
        from expkit.ownership import WorkDirBusy, WorkDirLock

        assert self.config is not None and self.launcher is not None
        check_seed_keys(self.config)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        try:  # one launch at a time: its trials are numbered, launched and told by this process
            owned = WorkDirLock(sweep_dir, "python -m expkit.train (Optuna sweep)").acquire()
        except WorkDirBusy as exc:
            raise SearchConfigError(f"{exc}. Several searches can share a study through hydra.sweeper.storage, "
                                    "each in a hydra.sweep.dir of its own") from None  # fmt: skip
        try:
            self._open_and_search(arguments, sweep_dir)
        finally:
            owned.release()

    def _open_and_search(self, arguments: list[str], sweep_dir: Path) -> None:
        import optuna

        from expkit import search
        from expkit.hydra_compat import instantiate
        from expkit.sweep_jobs import mark_launch

        assert self.config is not None
        mark_launch(self.n_trials * self.seeds_per_trial, sweep_dir)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        fixed, space = self._space(arguments)
        storage = self.storage or str(sweep_dir / "optuna.journal")  # the sweep dir keeps its own study

        def build(spec: Any) -> Any:  # Hydra builds nested _target_ nodes when it builds the sweeper
            return instantiate(spec) if isinstance(spec, (dict, DictConfig)) else spec

        sampler = build(self.sampler_cfg)
        pruner = build(self.pruner_cfg) or optuna.pruners.NopPruner()
        direction = self._direction()
        try:
            study = optuna.create_study(
                study_name=self.study_name,
                storage=search.open_storage(storage),
                sampler=sampler,
                pruner=pruner,
                direction=direction,
                load_if_exists=True,
            )
        except Exception as exc:  # a bad URL, an unreachable database, a dir that does not exist
            cause = (str(exc).splitlines() or [""])[0]  # SQLAlchemy appends SQL and a link
            raise SearchConfigError(f"hydra.sweeper.storage={storage}: {type(exc).__name__}: {cause}") from None
        study.sampler = self._continued(study, sampler, build)
        if study.direction.name.lower() != direction:
            raise SearchConfigError(f"study {self.study_name!r} in {storage} {study.direction.name.lower()}s; this search "
                             f"would {direction} (set hydra.sweeper.direction, or another study_name)")  # fmt: skip
        self._search(study, sweep_dir, storage, fixed, space, sampler, pruner, direction)

    def _continued(self, study: Any, sampler: Any, build: Any) -> Any:
        """The sampler for a study that already holds trials: a seeded sampler built again with
        its seed would draw the earlier trials' parameters again (a resumed search, or a new
        sweep dir on the same storage, repeated them); it is seeded from (seed, trials so far)
        instead, so that a continued search is reproducible and explores."""
        done = len(study.get_trials(deepcopy=False))
        spec = OmegaConf.select(self.config, "hydra.sweeper.sampler")  # (self.sampler_cfg: built by Hydra)
        seed = spec.get("seed") if isinstance(spec, DictConfig) and "_target_" in spec else None
        if not done or seed is None:  # a fresh study, or a sampler seeded by the OS: nothing repeats
            return sampler
        import numpy as np

        derived = int(np.random.SeedSequence([int(seed), done]).generate_state(1)[0])
        log.info("Optuna: the study holds %d trials; the sampler continues with seed %d (from seed %s and %d)",
                 done, derived, seed, done)  # fmt: skip
        return build({**OmegaConf.to_container(spec, resolve=True), "seed": derived})  # type: ignore[dict-item]

    def _search(self, study: Any, sweep_dir: Path, storage: str, fixed: list[str], space: dict[str, Any],
                sampler: Any, pruner: Any, direction: str) -> None:  # fmt: skip
        from expkit import search

        assert self.config is not None
        ledger = Ledger(sweep_dir / LEDGER)
        resume = bool(self.config.get("resume"))
        log.info("Optuna study %s (%s, %s): %d trials, %d at once; sampler %s, pruner %s", self.study_name,
                 storage, direction, self.n_trials, self.n_jobs, type(sampler).__name__,
                 type(pruner).__name__)  # fmt: skip
        if resume:
            self._resume(study, ledger, storage)
        todo = max(self.n_trials - len(ledger.trials), 0) if resume else self.n_trials
        seeds = self._seeds(fixed)
        while todo > 0:
            trials = [study.ask(fixed_distributions=space) for _ in range(min(self.n_jobs, todo))]
            jobs = [[[*fixed, *self._overrides(trial, space), *seed, *search.job_env(trial, self.study_name, storage)]
                     for seed in seeds] for trial in trials]  # fmt: skip
            self._run(study, ledger, trials, jobs, first=ledger.next_job(sweep_dir))
            todo -= len(trials)
        self._write_results(study, sweep_dir)

    def _seeds(self, fixed: list[str]) -> list[list[str]]:
        """Each trial's seed overrides: [[]] for one seed; else `seeds_per_trial` values of the
        first ``seed_keys`` key, from its configured value (0, 1, 2 for trainer.seed=0)."""
        if self.seeds_per_trial == 1:
            return [[]]
        assert self.config is not None
        key = str((self.config.get("seed_keys") or ["trainer.seed"])[0])
        if any(f.lstrip("+").partition("=")[0] == key for f in fixed):
            raise SearchConfigError(f"hydra.sweeper.seeds_per_trial={self.seeds_per_trial} sets {key} itself; "
                                    f"leave {key} out of the command line and the search space")  # fmt: skip
        base = OmegaConf.select(self.config, key)
        if isinstance(base, bool) or not isinstance(base, int):
            raise SearchConfigError(f"hydra.sweeper.seeds_per_trial: {key} (the first of seed_keys) is {base!r}, "
                                    "not a whole number to count seeds from")  # fmt: skip
        return [[f"{key}={base + i}"] for i in range(self.seeds_per_trial)]

    def _overrides(self, trial: Any, space: dict[str, Any]) -> list[str]:
        if self.custom_search_space:
            module, _, name = self.custom_search_space.rpartition(".")
            getattr(importlib.import_module(module), name)(self.config, trial)  # suggests more params
        return [f"{k}={override_value(v)}" for k, v in trial.params.items()]

    def _run(self, study: Any, ledger: "Ledger", trials: list[Any], jobs: list[list[list[str]]], first: int) -> None:
        """Launch every job of `trials` (``jobs[i]``: trial i's jobs, one per seed) as one batch,
        numbered from `first`, then tell the study how each trial ended."""
        flat: list[list[str]] = []
        for trial, own in zip(trials, jobs):
            ledger.add(trial, own, first + len(flat))
            flat += own
        self.validate_batch_is_legal(flat)
        returns = iter(self.launcher.launch(flat, initial_job_idx=first))
        for trial, own in zip(trials, jobs):
            self._tell(study, ledger, trial, [next(returns) for _ in own])

    def _tell(self, study: Any, ledger: "Ledger", trial: Any, rets: list[Any]) -> None:
        """The trial's value: its job's (with several seeds, their mean, once every seed finished);
        pruned if a seed was pruned; left running if a seed was interrupted (resume=true)."""
        from hydra.core.utils import JobStatus
        from optuna.trial import TrialState

        from expkit.sweep_jobs import finished, job_result

        ends = []
        for ret in rets:
            output_dir = OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir") if ret.hydra_cfg else None
            result = (job_result(Path(output_dir)) if output_dir else None) or {}
            monitor = result.get("monitor")
            best = (result.get("best_metrics") or {}).get(monitor or "", {}).get("value")
            value = ret.return_value if ret.status == JobStatus.COMPLETED else None
            usable = finished(result) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in (best, value))
            ends.append((result, value if usable else None))
            rule = result.get("monitor_rule")
            if rule in ("greater", "less") and rule != ("greater" if study.direction.name == "MAXIMIZE" else "less"):
                raise SearchConfigError(f"the study {study.direction.name.lower()}s, but {monitor} is better when "
                                        f"{rule} (the run's rule); set hydra.sweeper.direction")  # fmt: skip
        statuses = [r.get("status") for r, _ in ends]
        if any(r.get("status") == "stopped" and not finished(r) for r, _ in ends):
            ledger.finish(trial, "interrupted")  # preempted: left running in the study, for resume=true
            return
        if "pruned" in statuses:
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
            status = "pruned"
        elif all(v is not None for _, v in ends):
            study.tell(trial, math.fsum(v for _, v in ends) / len(ends), skip_if_finished=True)  # type: ignore[misc]
            status = "completed" if len(set(statuses)) > 1 else str(statuses[0])
        else:  # failed, diverged (no finite best), or never ran
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            status = next((s for s in statuses if s not in (None, "completed", "stopped")), "failed")
        ledger.finish(trial, status)

    def _resume(self, study: Any, ledger: "Ledger", storage: str) -> None:
        """Trials this sweep dir started that the study still holds as running: their sweep died.
        Each runs again in its own job dir (resuming from its checkpoint, or returning its result
        when it had finished) and is told to the study."""
        import optuna
        from optuna.trial import TrialState

        from expkit import search

        states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
        for number, entry in sorted(ledger.trials.items(), key=lambda kv: int(kv[0])):
            if states.get(int(number)) != TrialState.RUNNING:
                continue
            trial = optuna.trial.Trial(study, entry["trial_id"])
            jobs = []
            for overrides in entry.get("seed_overrides") or [entry["overrides"]]:
                job = [o for o in overrides if not o.startswith("+hydra.job.env_set.")]
                job += search.job_env(trial, self.study_name, storage)
                jobs.append(job if "resume=true" in job else [*job, "resume=true"])
            log.info("Optuna: trial %s was left running; resuming it in job %s", number, entry["job"])
            self._run(study, ledger, [trial], [jobs], first=int(entry["job"]))

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        """optimization_results.yaml, as hydra-optuna-sweeper wrote it: the study's best trial."""
        try:
            best = study.best_trial
        except ValueError:  # no trial completed
            log.warning("Optuna study %s has no completed trial", self.study_name)
            return
        results = {"name": "optuna", "study_name": self.study_name, "best_trial": best.number,
                   "best_params": dict(best.params), "best_value": best.value}  # fmt: skip
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        log.info("Optuna best: trial %d, value %.4f, %s", best.number, best.value, best.params)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.config is not None and self.hydra_context is not None
        check_batch(self.hydra_context, self.config, batch)


class Ledger:
    """``optuna_trials.json``: this sweep dir's trials (number -> trial id, job dir, overrides,
    status), written after every ask and every tell."""

    def __init__(self, path: Path) -> None:
        import json

        self.path = path
        try:
            self.trials: dict[str, dict[str, Any]] = json.loads(path.read_text())["trials"]
        except (OSError, ValueError, KeyError):
            self.trials = {}

    def add(self, trial: Any, jobs: list[list[str]], first: int) -> None:
        """The trial's jobs (one per seed), numbered from `first`."""
        entry = {"trial_id": trial._trial_id, "job": str(first), "overrides": jobs[0], "status": "running"}
        if len(jobs) > 1:
            entry.update(jobs=[str(first + i) for i in range(len(jobs))], seed_overrides=jobs)
        self.trials[str(trial.number)] = entry
        self._save()

    def finish(self, trial: Any, status: str) -> None:
        self.trials[str(trial.number)]["status"] = status
        self._save()

    def next_job(self, sweep_dir: Path) -> int:
        """The first job number after every job dir and every job of this ledger."""
        taken = [int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        taken += [int(j) for e in self.trials.values() for j in e.get("jobs") or [e["job"]]]
        return max(taken, default=-1) + 1

    def _save(self) -> None:
        from expkit.atomic import write_json_atomic

        write_json_atomic(self.path, {"trials": self.trials})
