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

The sweeper is this module; its parts are modules of their own beside it: ``_optuna_settings``
(checks, directions, errors), ``_optuna_space`` (the search space), ``_optuna_ledger`` (the sweep
dir's records), ``_optuna_trials`` (the slots), ``_optuna_results`` (telling the study).
"""

import logging
import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf

from expkit.core.errors import TaskExit
from expkit.sweeps.search import OBJECTIVES, StorageUnreachable, join_search, open_storage
from hydra_plugins.expkit_sweeper import sampler_configs  # noqa: F401 (registers hydra/sweeper/sampler)
from hydra_plugins.expkit_sweeper._optuna_ledger import BINDING, LEDGER, Ledger, bind_sweep_dir
from hydra_plugins.expkit_sweeper._optuna_results import TrialResults
from hydra_plugins.expkit_sweeper._optuna_settings import SearchConfigError, SearchSettings, one_line, storage_error
from hydra_plugins.expkit_sweeper._optuna_space import SEARCH_ATTR, SearchSpace, distribution, override_value
from hydra_plugins.expkit_sweeper._optuna_trials import WAIT, WAIT_S, TrialSlots, launch_lines_without_the_trial
from hydra_plugins.expkit_sweeper.expkit_sweeper import (
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


class OptunaSweeper(SearchSettings, SearchSpace, TrialSlots, TrialResults, Sweeper):
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
        self.launcher_module = ""  # the module of the launcher Hydra built (where it logs its jobs' lines)
        self.hydra_context: HydraContext | None = None
        self.in_process = False
        self.checked: set[tuple[str, str]] | None = None  # the choices composed jobs have held (None: no job yet)
        self.worker = ""  # this worker's name under <sweep dir>/.workers/ (set when the sweep starts)
        self.place = 0  # the lowest place under <sweep dir>/.workers/ no other running worker held (0: alone)
        self.exhausted = False  # a GridSampler's grid is gone through: no trial is asked for after it

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from expkit.core.hydra_compat import basic_launcher

        with one_line():
            self._check_settings(config)
        self.config, self.hydra_context = config, hydra_context
        with launcher_settings_checked():
            self.launcher = Plugins.instance().instantiate_launcher(
                hydra_context=hydra_context, task_function=task_function, config=config
            )
        self.in_process = type(self.launcher) is basic_launcher()
        self.launcher_module = type(self.launcher).__module__
        if self.in_process:
            self.hydra_context = compose_once(self.launcher, hydra_context)
        self.launcher = stoppable(self.launcher, config)

    def sweep(self, arguments: list[str]) -> None:
        from expkit.sweeps.sweep_jobs import launch

        assert self.config is not None and self.launcher is not None
        check_seed_keys(self.config)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        # this process is one worker of the search in this sweep dir; others (this command started
        # again, here or on another host that shares the dir) may join it: each holds the lock of
        # its own dir under .workers/, so a trial whose worker is gone is told from a running one
        self.worker = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        owned, self.place = join_search(sweep_dir, self.worker, "python -m expkit.train (Optuna worker)")
        try:
            with (
                launch(self.n_trials * self.seeds_per_trial, sweep_dir),
                one_line(),
                launch_lines_without_the_trial(self.launcher_module),
            ):
                self._open_and_search(arguments, sweep_dir)
        except StorageUnreachable as exc:
            # nothing is lost: the job in hand saved and stopped resumable, and its trial is left
            # running in the study; resume=true (or another worker) takes it over
            log.error("Error: %s. This worker stops; once the storage answers, continue with resume=true", exc)
            raise TaskExit(1) from None
        finally:
            owned.close()

    def _open_and_search(self, arguments: list[str], sweep_dir: Path) -> None:
        import optuna

        from expkit.core.hydra_compat import instantiate

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
                storage=open_storage(storage),
                sampler=sampler,
                pruner=pruner,
                directions=directions,
                load_if_exists=True,
            )
        except Exception as exc:  # a bad URL, an unreachable database, a dir that does not exist
            raise SearchConfigError(storage_error(storage, exc)) from None
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

    def _continued(self, study: Any, sampler: Any, build: Any) -> Any:
        """The sampler for a study that already holds trials: a seeded sampler built again with
        its seed would draw the earlier trials' parameters again (a resumed search, or a new
        sweep dir on the same storage, repeated them); it is seeded from (seed, trials so far,
        the worker's place in the sweep dir) instead, so that a continued search is reproducible
        and explores, and workers that run together draw different trials."""
        done = len(study.get_trials(deepcopy=False))
        spec = OmegaConf.select(self.config, "hydra.sweeper.sampler")  # (self.sampler_cfg: built by Hydra)
        seed = spec.get("seed") if isinstance(spec, DictConfig) and "_target_" in spec else None
        place = self.place  # a worker that joined others draws its own trials
        if (not done and not place) or seed is None:  # a fresh study, or a sampler seeded by the OS: nothing repeats
            return sampler
        import numpy as np

        derived = int(np.random.SeedSequence([int(seed), done, *([place] if place else [])]).generate_state(1)[0])
        log.info(
            "Optuna: the study holds %d trials; the sampler continues with seed %d (from seed %s, %d trials "
            "and worker place %d)",
            done,
            derived,
            seed,
            done,
            place,
        )
        return build({**OmegaConf.to_container(spec, resolve=True), "seed": derived})  # type: ignore[dict-item]

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.config is not None and self.hydra_context is not None
        check_batch(self.hydra_context, self.config, batch)
