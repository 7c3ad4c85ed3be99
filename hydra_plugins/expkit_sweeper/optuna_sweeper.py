"""expkit's Optuna sweeper (``hydra/sweeper=optuna``, picked by ``hparams_search=optuna``), on
current Optuna (>= 4), with the settings hydra-optuna-sweeper users know: ``direction``,
``study_name``, ``storage``, ``n_trials``, ``n_jobs``, ``sampler``, ``params`` and
``custom_search_space``, plus ``pruner``.

Each trial is asked for when a slot is free, launched as one job (one per seed) through the
configured launcher (basic, joblib, submitit...), and told to the study when it ends: its
returned value (the best ``monitor`` of the run), ``pruned`` (the job's ``TrialReportHook``
stopped it on the pruner's word) or ``failed``. With ``n_jobs`` K > 1 and a launcher whose
jobs run elsewhere, K threads of this process each launch one trial at a time: no batch
barrier (Hydra's launchers are batch-synchronous; a launch of one job is not). Jobs learn their
trial through ``hydra.job.env_set`` and reach the study through its storage, so pruning
works in any process. ``<sweep dir>/optuna_trials.json`` maps each trial of this sweep to
its job dir; ``resume=true`` runs again the trials a dead sweep left running (each resumes
from its checkpoint) and then the trials still missing from ``n_trials``.

Optuna is imported when the sweep starts, not when Hydra scans plugins (every command pays
for a scan).
"""

import contextlib
import importlib
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf

from expkit.core.errors import TaskExit
from expkit.sweeps.search import (
    OBJECTIVES,
    UNREACHABLE,
    WORKERS,
    StorageUnreachable,
    live_workers,
    objective_values,
    with_storage,
)
from hydra_plugins.expkit_sweeper import sampler_configs  # noqa: F401 (registers hydra/sweeper/sampler)
from hydra_plugins.expkit_sweeper.expkit_sweeper import (
    SweepConfigError,
    check_batch,
    check_seed_keys,
    compose_once,
    launcher_settings_checked,
    stoppable,
)

__all__ = [
    "BINDING",
    "LEDGER",
    "SEARCH_ATTR",
    "WAIT",
    "WAIT_S",
    "Ledger",
    "OptunaSweeper",
    "OptunaSweeperConf",
    "SearchConfigError",
    "bind_sweep_dir",
    "distribution",
    "override_value",
]


log = logging.getLogger("expkit")

LEDGER = "optuna_trials.json"


class SearchConfigError(SweepConfigError):
    """Bad sweeper settings: Hydra prints the message alone (no traceback) and expkit exits 2."""


@dataclass
class OptunaSweeperConf:  # OmegaConf reads these annotations at run time (hence Optional)
    """``hparams_search=optuna`` (``hydra/sweeper=optuna``): an Optuna study, trials in slots
    ([Sweeps](../sweeps.md), [Sweeps in practice](../sweeps-in-practice.md)).

    Attributes:
        direction: ``maximize`` or ``minimize``; None: from ``monitor``, by expkit's one rule
            of which direction is better.
        study_name: the study's name in its storage.
        storage: None: ``<sweep dir>/optuna.journal``; or ``sqlite:///study.db``, a
            ``.journal`` file, ``postgresql://...``.
        n_trials: trials this command runs (``resume=true``: until the sweep dir holds this many).
        n_jobs: trials at once (with a parallel launcher: joblib, submitit).
        sampler: the Optuna sampler, picked with ``hydra/sweeper/sampler=tpe|random|cmaes|qmc|grid|nsga2``
            (default: tpe), as a ``_target_`` node.
        pruner: an Optuna pruner as a ``_target_`` node; None: no pruning.
        params: name -> ``interval(..)``, ``tag(log, interval(..))``, ``choice(..)``, ``range(..)``.
        custom_search_space: ``"module.function"``: ``function(cfg, trial)`` suggests more.
        seeds_per_trial: N: each trial runs N jobs (seeds from ``seed_keys[0]``); the study
            gets their mean.
        storage_wait_s: how long the sweeper and its jobs retry an unreachable storage (a
            database server restarting) before the worker stops (exit 1; ``resume=true`` goes on).
        objectives: several objectives: metric keys of result.json (best, else final) or numbers it
            holds (``model_params``, ``wall_time_s``); None: ``monitor`` alone.
        directions: the objectives' directions; None: each metric's own rule.
    """

    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])  # hydra/sweeper/sampler=...
    _target_: str = "hydra_plugins.expkit_sweeper.optuna_sweeper.OptunaSweeper"
    # the sampler and pruner nodes reach the sweeper as configs, built when the sweep starts: a
    # setting a sampler does not take is then one line naming the group, not Hydra's wrapped TypeError
    _recursive_: bool = False
    direction: str | None = None  # maximize | minimize; null: from `monitor`, by expkit's one "better" rule
    study_name: str | None = "expkit"
    storage: str | None = (
        None  # null: <sweep dir>/optuna.journal; sqlite:///study.db; a .journal file; postgresql://...
    )
    n_trials: int = 20  # trials this command runs (resume=true: until the sweep dir holds this many)
    n_jobs: int = 1  # trials at once (with a parallel launcher: joblib, submitit)
    sampler: Any = MISSING  # from the group hydra/sweeper/sampler: tpe | random | cmaes | qmc | grid | nsga2
    pruner: Any = None  # {_target_: optuna.pruners.MedianPruner, ...}; null: no pruning
    params: dict[str, Any] | None = None  # name -> interval(..), tag(log, interval(..)), choice(..), range(..)
    custom_search_space: str | None = None  # "module.function": function(cfg, trial) suggests more
    seeds_per_trial: int = 1  # N: each trial runs N jobs (seeds from seed_keys[0]); the study gets their mean
    storage_wait_s: float = 120.0  # seconds an unreachable storage (a database restarting) is waited for
    objectives: list[str] | None = None  # [val/acc, model_params]: several objectives (a Pareto front); null: monitor
    directions: list[str] | None = None  # one per objective, maximize | minimize; null: each metric's own rule


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="expkit")


def distribution(value: Any) -> Any:
    """The Optuna distribution of a Hydra sweep value: interval (``tag(log, ...)`` for a log
    scale, ``tag(int, ...)`` for integers), range (Hydra's: the stop is excluded) or choice.

    Args:
        value: a parsed sweep (``Override.value()``): an ``IntervalSweep``, a ``RangeSweep`` or a
            ``ChoiceSweep``.

    Returns:
        An interval: a ``FloatDistribution``, or an ``IntDistribution`` with ``int`` (its ends truncated
            to integers); both log-scaled with ``log``. A range: an ``IntDistribution`` when start, stop
            and step are all ints, else a ``FloatDistribution``, from its lowest to its highest value with
            the step's absolute value (a negative step is allowed). A choice: a ``CategoricalDistribution``
            of its values, a list or dict value as its override text (``[1,2]``).

    Raises:
        ValueError: when a range holds no value or has a step of 0, or `value` is not an interval, range or
            choice sweep.
    """
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if step == 0:
            raise ValueError(f"range({start}, {stop}, 0) has a step of 0; give a step that is not 0")
        count = sum(1 for _ in value.range())  # as many values as Hydra's own sweep of it runs
        if count < 1:
            raise ValueError(f"range({start}, {stop}, {step}) holds no value")
        if all(isinstance(x, int) for x in (start, stop, step)):
            last = start + step * (count - 1)
            return IntDistribution(min(start, last), max(start, last), step=abs(step))
        # the ends in decimal, as typed: start + 3 * 0.3 in binary floats is 0.8999999999999999, which
        # Optuna's step check (in decimal) rounds down to 0.6, losing a value of the range
        ends = (Decimal(str(start)), Decimal(str(start)) + Decimal(str(step)) * (count - 1))
        return FloatDistribution(float(min(ends)), float(max(ends)), step=abs(float(step)))
    if isinstance(value, ChoiceSweep):
        primitive = (type(None), bool, int, float, str)
        return CategoricalDistribution(
            [v if isinstance(v, primitive) else Override._get_value_element_as_str(v) for v in value.list]
        )
    raise ValueError(f"{value!r} is not interval(...), range(...) or choice(...)")


def override_value(value: Any) -> str:
    """The override text (the part after ``=``) of a value a trial took.

    Args:
        value: a value from ``trial.params``: a number, bool, None or string; a list or dict choice
            comes as its override text (see ``distribution``).

    Returns:
        A string starting with ``[`` or ``{`` as it is; any other value as Hydra writes an override
            value (``null`` for None, special characters of a string escaped).
    """
    from hydra.core.override_parser.types import Override

    if isinstance(value, str) and value[:1] in "[{":  # a list or dict choice, kept as its override text
        return value
    return Override._get_value_element_as_str(value)


class OptunaSweeper(Sweeper):
    """``hydra/sweeper=optuna``: an Optuna study searched in slots, each trial launched as one job per
    seed and told to the study when it ends (see the module docstring).

    Args:
        direction: ``maximize`` or ``minimize``; None: from the config's ``monitor``, by the run's rule
            of which direction is better. An existing study must have the same direction.
        study_name: the study's name in its storage; None: ``expkit``. An existing study of that name
            is continued, and must hold the same search space.
        storage: None: ``<sweep dir>/optuna.journal``; else an Optuna storage URL (``sqlite:///study.db``,
            ``postgresql://...``) or a ``.journal`` file.
        n_trials: the trials this command runs, on top of those the sweep dir holds (with
            ``resume=true``: until it holds this many); at least 1.
        n_jobs: the trials run at once, each in its own thread, with a launcher whose jobs run in
            other processes; the in-process launcher runs one at a time. At least 1.
        sampler: the Optuna sampler, or a ``_target_`` node built when the sweep starts (a seeded one
            continuing a study gets a seed derived from its seed and the trials so far); None: Optuna's
            default (TPE).
        pruner: the Optuna pruner the jobs' ``TrialReportHook`` asks, or a ``_target_`` node; None: no
            pruning.
        params: the search space by config key, in Hydra's sweep syntax (``interval(..)``,
            ``tag(log, interval(..))``, ``range(..)``, ``choice(..)``); a plain value is a fixed override.
            A command-line override of the same key replaces its entry. None: none.
        custom_search_space: ``"module.function"``, called as ``function(config, trial)`` for each new
            trial to suggest more parameters; None: none.
        seeds_per_trial: the jobs each trial runs, with the first ``seed_keys`` key (default
            ``trainer.seed``) at its configured value + 0, 1, ...; the study gets their mean. At least 1.
        storage_wait_s: the seconds a storage that stops answering (a database restarting) is tried
            again, with backoff, by this worker and by its jobs; past that the job in hand stops
            (``stopped``, resumable), and the worker stops with exit 1. At least 0.
        objectives: several objectives, each a metric key of the jobs' result.json (its best value,
            else its final one) or a number result.json holds (``model_params``, ``wall_time_s``):
            the study is a multi-objective one and the summary marks its Pareto front; None:
            ``monitor`` alone.
        directions: one per objective, ``maximize`` or ``minimize``; None: each metric's own rule
            (a key without one is refused before any trial).

    Raises:
        SearchConfigError: `direction` is not maximize, minimize or None, `n_trials`, `n_jobs` or
            `seeds_per_trial` is not a whole number >= 1, or `storage_wait_s` is not a number >= 0.
    """

    def __init__(
        self,
        direction: str | None = None,
        study_name: str | None = "expkit",
        storage: str | None = None,
        n_trials: int = 20,
        n_jobs: int = 1,
        sampler: Any = None,
        pruner: Any = None,
        params: dict[str, Any] | None = None,
        custom_search_space: str | None = None,
        seeds_per_trial: int = 1,
        storage_wait_s: float = 120.0,
        objectives: list[str] | None = None,
        directions: list[str] | None = None,
    ) -> None:
        # checked in setup(): an error raised here reaches the user wrapped in Hydra's
        # "Error in call to target ..." lines instead of as one line
        self.storage_wait_s = storage_wait_s
        self.objectives = None if objectives is None else list(objectives)
        self.directions = None if directions is None else list(directions)
        self.direction, self.study_name, self.storage = direction, study_name or "expkit", storage
        self.n_trials, self.n_jobs, self.seeds_per_trial = n_trials, n_jobs, seeds_per_trial
        self.sampler_cfg, self.pruner_cfg = sampler, pruner
        self.params, self.custom_search_space = dict(params or {}), custom_search_space
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None
        self.in_process = False
        self.checked: set[tuple[str, str]] | None = None  # the choices composed jobs have held (None: no job yet)
        self.worker = ""  # this worker's name under <sweep dir>/.workers/ (set when the sweep starts)
        self.peers = 0  # workers of this search already running when this one started
        self.exhausted = False  # a GridSampler's grid is gone through: no trial is asked for after it

    def _check_settings(self, config: DictConfig) -> None:
        """The settings, before anything starts (see the class's Raises)."""
        if self.direction not in (None, "maximize", "minimize"):
            raise SearchConfigError(
                f"hydra.sweeper.direction={self.direction}: use maximize, minimize, or null (from monitor)"
            )
        numbers = (("n_trials", self.n_trials), ("n_jobs", self.n_jobs), ("seeds_per_trial", self.seeds_per_trial))
        for key, number in numbers:
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise SearchConfigError(f"hydra.sweeper.{key}={number}: give a whole number >= 1")
        wait = self.storage_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise SearchConfigError(f"hydra.sweeper.storage_wait_s={wait}: give seconds, a number >= 0")
        self.storage_wait_s = float(wait)
        if self.objectives is not None:
            names = self.objectives
            if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
                raise SearchConfigError(
                    f"hydra.sweeper.objectives={names}: give distinct keys, e.g. hydra.sweeper.objectives=[val/acc,model_params]"
                )
            if self.directions is not None and len(self.directions) != len(names):
                raise SearchConfigError(
                    f"hydra.sweeper.directions={self.directions}: give one per objective ({len(names)}: {', '.join(names)})"
                )
            if len(names) > 1 and self.pruner_cfg is not None:
                raise SearchConfigError(
                    "hydra.sweeper.pruner: Optuna cannot prune a study of several objectives (Trial.report takes "
                    "one value); set hydra.sweeper.pruner=null"
                )
        for direction in self.directions or []:
            if direction not in ("maximize", "minimize"):
                raise SearchConfigError(f"hydra.sweeper.directions: {direction}: use maximize or minimize")
        seed_keys = config.get("seed_keys")
        if self.seeds_per_trial > 1 and seed_keys is not None and len(seed_keys) == 0:
            raise SearchConfigError(
                f"hydra.sweeper.seeds_per_trial={self.seeds_per_trial} varies the first of seed_keys, but "
                "seed_keys=[] names none: give seed_keys=[trainer.seed] (or seeds_per_trial=1)"
            )

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from expkit.core.hydra_compat import basic_launcher

        with _one_line():
            self._check_settings(config)
        self.config, self.hydra_context = config, hydra_context
        with launcher_settings_checked():
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
                    raise SearchConfigError(
                        f"hydra.sweeper.params.{key}={override.input_line.partition('=')[2]}: {exc}"
                    ) from None
            else:
                fixed[key] = override.input_line
        return list(fixed.values()), space

    def _study_directions(self) -> list[str]:
        """One direction per objective: ``directions``, else each metric's own rule (see
        ``_direction``); a key without a rule is refused, naming it."""
        if self.objectives is None:
            return [self._direction()]
        if self.directions is not None:
            return list(self.directions)
        from expkit.config.build import build_metrics
        from expkit.metrics import Directions

        assert self.config is not None
        try:
            rules = Directions(build_metrics(self.config.get("metrics")))
        except Exception:  # (the metrics cannot be built here: the names' rules still hold)
            rules = Directions({})
        found = {key: rules.rule(key) for key in self.objectives}
        unknown = [key for key, rule in found.items() if rule is None]
        if unknown:
            example = ",".join(
                "maximize" if rule == "greater" else "minimize" if rule == "less" else "<maximize|minimize>"
                for rule in found.values()
            )
            raise SearchConfigError(
                f"hydra.sweeper.objectives: {', '.join(unknown)} {'has' if len(unknown) == 1 else 'have'} no rule of "
                f"which direction is better; give one direction per objective: hydra.sweeper.directions=[{example}]"
            )
        return ["maximize" if rule == "greater" else "minimize" for rule in found.values()]

    def _direction(self) -> str:
        """`direction`, else the run's own rule for `monitor`: its metric's setting or the metric
        object's ``higher_is_better`` (torchmetrics' MeanSquaredError: less), then the name."""
        if self.direction is not None:
            return self.direction
        from expkit.config.build import build_metrics
        from expkit.metrics import Directions, monitor_of

        assert self.config is not None
        monitor, rule = monitor_of(OmegaConf.to_container(self.config, resolve=False))  # type: ignore[arg-type]
        try:
            rule = Directions(build_metrics(self.config.get("metrics"))).rule(monitor) or rule
        except Exception as exc:
            log.warning("Optuna: could not build the metrics to read %s's direction (%s); using %s", monitor, exc, rule)
        return "maximize" if rule == "greater" else "minimize"

    # -- the sweep -------------------------------------------------------------------------------
    def sweep(self, arguments: list[str]) -> None:
        from expkit.sweeps.sweep_jobs import launch
        from expkit.workdir.ownership import WorkDirLock

        assert self.config is not None and self.launcher is not None
        check_seed_keys(self.config)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        # this process is one worker of the search in this sweep dir; others (this command started
        # again, here or on another host that shares the dir) may join it: each holds the lock of
        # its own dir under .workers/, so a trial whose worker is gone is told from a running one
        self.worker = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.peers = live_workers(sweep_dir)  # (before this one: its ordinal among the live workers)
        owned = WorkDirLock(sweep_dir / WORKERS / self.worker, "python -m expkit.train (Optuna worker)").acquire()
        try:
            with launch(self.n_trials * self.seeds_per_trial, sweep_dir), _one_line():
                self._open_and_search(arguments, sweep_dir)
        except StorageUnreachable as exc:
            # nothing is lost: the job in hand saved and stopped resumable, and its trial is left
            # running in the study; resume=true (or another worker) takes it over
            log.error("Error: %s. This worker stops; once the storage answers, continue with resume=true", exc)
            raise TaskExit(1) from None
        finally:
            owned.release()

    def _open_and_search(self, arguments: list[str], sweep_dir: Path) -> None:
        import optuna

        from expkit.core.hydra_compat import instantiate
        from expkit.sweeps import search

        assert self.config is not None
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        fixed, space = self._space(arguments)
        storage = self.storage or str(sweep_dir / "optuna.journal")  # the sweep dir keeps its own study

        def build(spec: Any, key: str = "sampler") -> Any:  # (a built object, from Python, is used as it is)
            if not isinstance(spec, (dict, DictConfig)):
                return spec
            if key == "sampler":
                spec = self._grid(spec, space)
            try:
                return instantiate(spec)
            except Exception as exc:
                target = str(spec.get("_target_", "?")).rpartition(".")[2]
                cause = (str(exc.__cause__ or exc).splitlines() or [""])[0]
                group = "hydra/sweeper/sampler=tpe|random|cmaes|qmc|grid|nsga2" if key == "sampler" else "its settings"
                raise SearchConfigError(
                    f"hydra.sweeper.{key}: {target} cannot be built ({cause}); a {key} keeps the settings "
                    f"of the one it replaces when only its _target_ is changed: pick it with {group}"
                ) from None

        sampler = build(self.sampler_cfg)
        pruner = build(self.pruner_cfg, "pruner") or optuna.pruners.NopPruner()
        directions = self._study_directions()
        direction = ", ".join(directions)
        try:
            study = optuna.create_study(
                study_name=self.study_name,
                storage=search.open_storage(storage),
                sampler=sampler,
                pruner=pruner,
                directions=directions,
                load_if_exists=True,
            )
        except Exception as exc:  # a bad URL, an unreachable database, a dir that does not exist
            raise SearchConfigError(_storage_error(storage, exc)) from None
        study.sampler = self._continued(study, sampler, build)
        theirs = ", ".join(d.name.lower() for d in study.directions)
        if theirs != direction:
            raise SearchConfigError(
                f"study {self.study_name!r} in {storage} {theirs}s; this search would {direction} "
                "(set hydra.sweeper.direction or directions, or another study_name)"
            )
        if self.objectives is not None:  # what the summary marks the Pareto front by
            from expkit.core.atomic import write_json_atomic

            write_json_atomic(sweep_dir / OBJECTIVES, {"objectives": self.objectives, "directions": directions})
        self._same_search(study, storage, space)
        bind_sweep_dir(sweep_dir, storage, self.study_name)
        self._search(study, sweep_dir, storage, fixed, space, sampler, pruner, direction)

    @staticmethod
    def _grid(spec: Any, space: dict[str, Any]) -> Any:
        """A GridSampler without a ``search_space``: the grid of the search space's choices and
        ranges (an interval has no grid: refused, naming it)."""
        from optuna.distributions import CategoricalDistribution

        if not str(spec.get("_target_", "")).endswith("GridSampler") or spec.get("search_space") is not None:
            return spec
        grid: dict[str, list[Any]] = {}
        for key, dist in space.items():
            if isinstance(dist, CategoricalDistribution):
                grid[key] = list(dist.choices)
            elif getattr(dist, "step", None) is not None:
                count = round((dist.high - dist.low) / dist.step) + 1
                grid[key] = [dist.low + i * dist.step for i in range(count)]
                if isinstance(dist.low, float):
                    grid[key] = [round(v, 12) for v in grid[key]]
            else:
                raise SearchConfigError(
                    f"hydra/sweeper/sampler=grid: {key} is an interval, which has no grid; give it as "
                    f"choice(...) or range(...), or give hydra.sweeper.sampler.search_space"
                )
        if not grid:
            raise SearchConfigError("hydra/sweeper/sampler=grid: the search space is empty (hydra.sweeper.params)")
        return {**OmegaConf.to_container(spec, resolve=True), "search_space": grid}  # type: ignore[dict-item]

    def _same_search(self, study: Any, storage: str, space: dict[str, Any]) -> None:
        """A study is one search: its space (and custom_search_space) is recorded in the study by
        the first search; another search pointed at the same study name stops here (exit 2)."""
        from optuna.distributions import distribution_to_json

        mine = {
            "params": {k: json.loads(distribution_to_json(d)) for k, d in sorted(space.items())},
            "custom_search_space": self.custom_search_space,
        }
        theirs = study.user_attrs.get(SEARCH_ATTR)
        if theirs is None:
            study.set_user_attr(SEARCH_ATTR, mine)
        elif theirs != mine:
            raise SearchConfigError(
                f"study {self.study_name!r} in {storage} is another search: its space is "
                f"{_space_text(theirs)}; this one's is {_space_text(mine)}. Give this search "
                "another hydra.sweeper.study_name (or the same space)"
            )

    def _continued(self, study: Any, sampler: Any, build: Any) -> Any:
        """The sampler for a study that already holds trials: a seeded sampler built again with
        its seed would draw the earlier trials' parameters again (a resumed search, or a new
        sweep dir on the same storage, repeated them); it is seeded from (seed, trials so far)
        instead, so that a continued search is reproducible and explores."""
        done = len(study.get_trials(deepcopy=False))
        spec = OmegaConf.select(self.config, "hydra.sweeper.sampler")  # (self.sampler_cfg: built by Hydra)
        seed = spec.get("seed") if isinstance(spec, DictConfig) and "_target_" in spec else None
        peers = self.peers  # workers of this search already running: each draws its own trials
        if (not done and not peers) or seed is None:  # a fresh study, or a sampler seeded by the OS: nothing repeats
            return sampler
        import numpy as np

        derived = int(np.random.SeedSequence([int(seed), done, *([peers] if peers else [])]).generate_state(1)[0])
        log.info(
            "Optuna: the study holds %d trials; the sampler continues with seed %d (from seed %s and %d)",
            done,
            derived,
            seed,
            done,
        )
        return build({**OmegaConf.to_container(spec, resolve=True), "seed": derived})  # type: ignore[dict-item]

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

        from expkit.sweeps import search
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
                    if int(number) in running and entry.get("worker") != self.worker and not _alive(sweep_dir, entry):
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
                            search.job_env(trial),
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

    def _join(self, ledger: "Ledger", sweep_dir: Path) -> int:
        """Join the launch of this sweep dir whose workers still run, or begin a new one; the
        number of trials the sweep dir held when it began. ``n_trials`` counts from there: a
        new launch runs ``n_trials`` more (as Hydra's sweepers run a sweep again), and
        ``resume=true`` begins from none (the sweep dir ends up holding ``n_trials``)."""
        assert self.config is not None
        with ledger.locked():
            launch = ledger.launch
            members = [m for m in launch.get("members") or [] if isinstance(m, str)]
            if any(m != self.worker and _worker_alive(sweep_dir, m) for m in members):
                launch["members"] = [*members, self.worker]  # (workers started together, or joining)
            else:
                base = 0 if self.config.get("resume") else len(ledger.trials)
                ledger.launch = launch = {"base": base, "members": [self.worker]}
            ledger.save()
        base = launch.get("base")
        return base if isinstance(base, int) and base >= 0 else 0

    def _take_over(
        self, study: Any, ledger: "Ledger", storage: str, entry: dict[str, Any], number: str
    ) -> tuple[Any, list[list[str]], int]:
        """A trial whose worker is gone (killed, or stopped by a signal) with the trial left
        running: this worker runs its jobs again in their own dirs (each resumes from its
        checkpoint, or returns its result if it had finished) and tells the study."""
        import optuna

        from expkit.sweeps import search

        trial = with_storage(
            f"taking over trial {number}", lambda: optuna.trial.Trial(study, entry["trial_id"]), self.storage_wait_s
        )
        jobs = []
        for overrides in entry.get("seed_overrides") or [entry["overrides"]]:
            # (the ledger of an earlier expkit holds +hydra.job.env_set.VAR=... overrides)
            job = [o for o in overrides if not o.startswith(("+hydra.job.env_set.", "hydra.job.env_set="))]
            job.append(search.job_env(trial))
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
        self, slots: int, take: Any, study: Any, ledger: "Ledger", lock: threading.Lock, sweep_dir: Path
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
        ledger: "Ledger",
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

    def _overrides(self, trial: Any, space: dict[str, Any]) -> list[str]:
        if self.custom_search_space:
            module, _, name = self.custom_search_space.rpartition(".")
            getattr(importlib.import_module(module), name)(self.config, trial)  # suggests more params
        return [f"{k}={override_value(v)}" for k, v in trial.params.items()]

    def _add(self, ledger: "Ledger", trial: Any, jobs: list[list[str]], first: int) -> None:
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

    def _tell(self, study: Any, ledger: "Ledger", trial: Any, rets: Sequence[Any]) -> None:
        """The trial's value: its job's (with several seeds, their mean, once every seed finished);
        pruned if a seed was pruned; left running if a seed was interrupted (resume=true)."""
        from hydra.core.utils import JobStatus
        from optuna.trial import TrialState

        from expkit.sweeps.sweep_jobs import finished, job_result

        ends: list[tuple[dict[str, Any], Any]] = []
        for ret in rets:
            output_dir = OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir") if ret.hydra_cfg else None
            result = (job_result(Path(output_dir)) if output_dir else None) or {}
            if self.objectives is not None:  # several objectives: each read from result.json
                values = objective_values(result, self.objectives)
                usable = ret.status == JobStatus.COMPLETED and finished(result) and None not in values
                ends.append((result, values if usable else None))
                continue
            monitor = result.get("monitor")
            best = (result.get("best_metrics") or {}).get(monitor or "", {}).get("value")
            value = ret.return_value if ret.status == JobStatus.COMPLETED else None
            usable = finished(result) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in (best, value))
            ends.append((result, value if usable else None))
            rule = result.get("monitor_rule")
            if rule in ("greater", "less") and rule != ("greater" if study.direction.name == "MAXIMIZE" else "less"):
                raise SearchConfigError(
                    f"the study {study.direction.name.lower()}s, but {monitor} is better when "
                    f"{rule} (the run's rule); set hydra.sweeper.direction"
                )
        statuses = [r.get("status") for r, _ in ends]
        if any(r.get("status") == "stopped" and not finished(r) for r, _ in ends):
            ledger.finish(trial, "interrupted")  # preempted: left running in the study, for resume=true
            outage = next(
                (str(r["stop_reason"]) for r, _ in ends if str(r.get("stop_reason")).startswith(UNREACHABLE)), None
            )
            if outage is not None:  # (the job waited for the storage already: so does this worker)
                raise StorageUnreachable(outage.removeprefix(f"{UNREACHABLE}: "))
            return
        number = trial.number
        if "pruned" in statuses:
            tell = lambda: study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
            status = "pruned"
        elif all(v is not None for _, v in ends):
            if self.objectives is not None:  # each objective's mean over the seeds
                told: Any = [math.fsum(v[i] for _, v in ends) / len(ends) for i in range(len(self.objectives))]  # type: ignore[index]
            else:
                told = math.fsum(v for _, v in ends) / len(ends)  # type: ignore[misc]
            tell = lambda: study.tell(trial, told, skip_if_finished=True)
            status = "completed" if len(set(statuses)) > 1 else str(statuses[0])
        else:  # failed, diverged (no finite best), or never ran
            tell = lambda: study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            status = next((s for s in statuses if s not in (None, "completed", "stopped")), "failed")
        # (an outage past the wait leaves the trial running in the study and in the ledger: the job's
        # result is on disk, and resume=true tells it)
        try:
            with_storage(f"telling trial {number} how it ended ({status})", tell, self.storage_wait_s)
        except RuntimeError as exc:
            if "Study.stop" not in str(exc):
                raise
            # GridSampler stops the study once every point of its grid is asked for (it calls
            # study.stop(), which only an optimize() loop takes): the trial was told all the same
            # (Optuna stores it in a finally), and no new trial is asked for
            log.info("Optuna: the grid is gone through; no new trial is asked for")
            self.exhausted = True
        ledger.finish(trial, status)

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        """optimization_results.yaml, as hydra-optuna-sweeper wrote it: the study's best trial (its
        best trials, the Pareto front, for several objectives)."""
        if len(study.directions) > 1:
            front = study.best_trials
            results = {
                "name": "optuna",
                "study_name": self.study_name,
                "objectives": self.objectives,
                "solutions": [{"number": t.number, "params": dict(t.params), "values": t.values} for t in front],
            }
            OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
            log.info("Optuna Pareto front: trials %s", ", ".join(str(t.number) for t in front) or "none")
            return
        try:
            best = study.best_trial
        except ValueError:  # no trial completed
            log.warning("Optuna study %s has no completed trial", self.study_name)
            return
        results = {
            "name": "optuna",
            "study_name": self.study_name,
            "best_trial": best.number,
            "best_params": dict(best.params),
            "best_value": best.value,
        }
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        log.info("Optuna best: trial %d, value %.4f, %s", best.number, best.value, best.params)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.config is not None and self.hydra_context is not None
        check_batch(self.hydra_context, self.config, batch)


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    """A SearchConfigError inside leaves as one ``Error:`` line and exit 2 (Hydra would add a line
    about HYDRA_FULL_ERROR, and wrap one raised while it builds the sweeper in three more)."""
    try:
        yield
    except SearchConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2) from None


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


WAIT = "wait"  # (take(): other workers' trials still run)
WAIT_S = 2.0
SEARCH_ATTR = "expkit_search"  # the study's user attribute that records its search space
BINDING = ".search.json"  # <sweep dir>/.search.json: the study this sweep dir's trials belong to


def _alive(sweep_dir: Path, entry: dict[str, Any]) -> bool:
    """Whether a ledger entry's trial is still in hand: its worker runs (holds its lock), or one
    of its jobs does (a submitit job outlives the worker that launched it)."""
    from expkit.core.confine import confined
    from expkit.workdir.ownership import live_owner

    if _worker_alive(sweep_dir, entry.get("worker")):
        return True
    jobs = [
        confined(sweep_dir, job, sweep_dir / LEDGER, "job dir")
        for job in entry.get("jobs") or [entry.get("job")]
        if job
    ]
    return any(job is not None and live_owner(job) is not None for job in jobs)


def _worker_alive(sweep_dir: Path, worker: Any) -> bool:
    """Whether the worker of that name (read from the ledger) still runs: it holds its dir's lock."""
    from expkit.core.confine import confined
    from expkit.workdir.ownership import live_owner

    where = confined(sweep_dir / WORKERS, worker, sweep_dir / LEDGER, "worker dir") if isinstance(worker, str) else None
    return where is not None and live_owner(where) is not None


def bind_sweep_dir(sweep_dir: Path, storage: str | None, study_name: str) -> None:
    """A sweep dir holds the trials of one study: the first worker records which; a command
    aimed at it with another study or storage stops (exit 2) before it asks for a trial.

    Args:
        sweep_dir: the sweep dir; the binding is ``<sweep_dir>/.search.json``, written once (by a hard
            link, so the first worker wins) with `study_name` and `storage`.
        storage: the study's storage, as the sweep opens it (the default journal's path when none was
            given); compared as text.
        study_name: the study's name in its storage.

    Raises:
        SearchConfigError: when the recorded study name or storage differs from `study_name` and
            `storage` (a binding that cannot be read or parsed counts as the same).
    """
    mine = {"study_name": study_name, "storage": storage}
    path = sweep_dir / BINDING
    if not path.exists():
        tmp = path.with_name(f".{BINDING}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(mine))
        with contextlib.suppress(FileExistsError):  # (another worker recorded it first: compared below)
            os.link(tmp, path)
        tmp.unlink()
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError):
        theirs = mine
    if theirs != mine:
        where = lambda b: f"study {b.get('study_name')!r} in {b.get('storage') or 'the sweep dir'}"
        raise SearchConfigError(
            f"hydra.sweep.dir={sweep_dir} holds the trials of {where(theirs)}; this command "
            f"searches {where(mine)}. Give another hydra.sweep.dir, or the same "
            "hydra.sweeper.study_name and storage to join that search"
        )


def _storage_error(storage: str, exc: Exception) -> str:
    """What went wrong opening `storage`, and how to check it."""
    from expkit.sweeps.search import shown_url

    cause = (str(exc).splitlines() or [""])[0]  # SQLAlchemy appends SQL and a link
    scheme = storage.partition("://")[0].partition("+")[0] if "://" in storage else ""
    if isinstance(exc, ModuleNotFoundError) and scheme in ("postgresql", "postgres"):
        check = "install the driver: pip install -e '.[postgres]' (psycopg)"
    elif scheme in ("postgresql", "postgres"):
        check = (
            f"check that the server runs and takes connections from here: pg_isready -d '{shown_url(storage)}' "
            "(or psql with the same URL); the form is postgresql://user:password@host:5432/database"
        )
    elif scheme == "sqlite":
        check = "check that the file's dir exists and is writable (sqlite:///relative/path.db, sqlite:////abs/path.db)"
    elif scheme:
        check = "check the URL (SQLAlchemy's form: dialect+driver://user:password@host:port/database)"
    else:
        check = "give a journal file (a path ending in .journal) in a writable dir, or a database URL"
    return f"hydra.sweeper.storage={shown_url(storage)}: {type(exc).__name__}: {cause}. {check}"


def _space_text(search: dict[str, Any]) -> str:
    params = search.get("params") or {}
    text = ", ".join(f"{k}: {v.get('name', '?')}{v.get('attributes', '')}" for k, v in params.items())
    custom = search.get("custom_search_space")
    return "{" + text + "}" + (f" + {custom}" if custom else "")
