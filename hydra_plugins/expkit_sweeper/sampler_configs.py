"""The Optuna samplers as a config group, as Hydra's own Optuna sweeper has them:
``hydra/sweeper/sampler=tpe|random|cmaes|qmc|grid|nsga2``, each with its documented settings
(Optuna's defaults, except where a comment says why). Picking a sampler by its group replaces
the whole node, so no setting of another sampler is left behind (swapping ``_target_`` alone
keeps the old sampler's settings, which the new one may not take: the sweeper then names this
group).
"""

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

__all__ = [
    "SAMPLERS",
    "CmaEsSamplerConf",
    "GridSamplerConf",
    "NSGAIISamplerConf",
    "QMCSamplerConf",
    "RandomSamplerConf",
    "TPESamplerConf",
]


@dataclass
class TPESamplerConf:
    """``hydra/sweeper/sampler=tpe`` (the default for one objective): Optuna's TPESampler.

    Attributes:
        seed: the sampler's seed; None: from the OS.
        n_startup_trials: random trials before TPE models the results.
        multivariate: model the parameters jointly (Optuna's multivariate TPE).
        constant_liar: trials still running count as bad ones, so trials run at once spread out
            (on here, unlike Optuna's default: expkit runs trials in slots).
    """

    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None  # null: from the OS
    n_startup_trials: int = 10  # random trials before TPE models the results
    multivariate: bool = False  # model the parameters jointly
    constant_liar: bool = True  # running trials count as bad ones: slots spread out (Optuna's default: false)


@dataclass
class RandomSamplerConf:
    """``hydra/sweeper/sampler=random``: Optuna's RandomSampler.

    Attributes:
        seed: the sampler's seed; None: from the OS.
    """

    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None  # null: from the OS


@dataclass
class CmaEsSamplerConf:
    """``hydra/sweeper/sampler=cmaes``: Optuna's CmaEsSampler (numeric parameters; the ``cmaes``
    package, in the sweep extra).

    Attributes:
        seed: the sampler's seed; None: from the OS.
        n_startup_trials: random trials before CMA-ES starts.
        sigma0: the initial step size; None: a sixth of the search space's range.
        restart_strategy: None, or ``ipop`` / ``bipop`` (restarts with a larger population).
        with_margin: the margin for integer and discrete parameters (CMA-ES with margin).
    """

    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = None  # null: from the OS
    n_startup_trials: int = 1  # random trials before CMA-ES starts
    sigma0: float | None = None  # initial step size; null: a sixth of the range
    restart_strategy: str | None = None  # null | ipop | bipop
    with_margin: bool = False  # CMA-ES with margin, for integer and discrete parameters


@dataclass
class QMCSamplerConf:
    """``hydra/sweeper/sampler=qmc``: Optuna's QMCSampler (quasi-Monte Carlo: space-filling).

    Attributes:
        seed: the sampler's seed; None: from the OS.
        qmc_type: ``sobol`` or ``halton``.
        scramble: scramble the sequence (with the seed).
    """

    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = None  # null: from the OS
    qmc_type: str = "sobol"  # sobol | halton
    scramble: bool = False  # scramble the sequence (with the seed)


@dataclass
class GridSamplerConf:
    """``hydra/sweeper/sampler=grid``: Optuna's GridSampler.

    Attributes:
        seed: the order in which the grid is gone through; None: from the OS.
        search_space: the grid, parameter -> list of values; None: from the search space
            (``choice(..)`` and ``range(..)``; an ``interval`` has no grid and is refused).
    """

    _target_: str = "optuna.samplers.GridSampler"
    seed: int | None = None  # the order the grid is gone through; null: from the OS
    search_space: dict[str, Any] | None = None  # param -> [values]; null: from params (choice, range)


@dataclass
class NSGAIISamplerConf:
    """``hydra/sweeper/sampler=nsga2`` (the default for several objectives): Optuna's NSGAIISampler.

    Attributes:
        seed: the sampler's seed; None: from the OS.
        population_size: trials per generation.
        mutation_prob: the probability of a parameter's mutation; None: 1 / the number of parameters.
        crossover_prob: the probability of a crossover.
        swapping_prob: the probability of swapping each parameter of the parents.
    """

    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None  # null: from the OS
    population_size: int = 50  # trials per generation
    mutation_prob: float | None = None  # null: 1 / the number of parameters
    crossover_prob: float = 0.9  # probability of a crossover
    swapping_prob: float = 0.5  # probability of swapping each parameter of the parents


SAMPLERS = {
    "tpe": TPESamplerConf,
    "random": RandomSamplerConf,
    "cmaes": CmaEsSamplerConf,
    "qmc": QMCSamplerConf,
    "grid": GridSamplerConf,
    "nsga2": NSGAIISamplerConf,
}

for _name, _node in SAMPLERS.items():
    ConfigStore.instance().store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="expkit")
