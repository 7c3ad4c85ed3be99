"""The check's plan: how many iterations each run trains and where the interrupted run is
killed, from the train loader's length; and the ``check.`` settings, refused before anything
trains when the check cannot use them."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from expkit.core.errors import ConfigError

__all__ = ["SETTINGS", "Plan", "plan", "validate_settings"]

# the keys of check.yaml's `check:`, in its order
SETTINGS = ("iters", "kill_at", "keep", "dir", "out")


@dataclass
class Plan:
    """What the check trains: each run's budget and where the interrupted run is killed.

    Args:
        steps_per_epoch: the optimizer steps of one epoch (per process).
        budget: the iterations each run trains.
        kill_at: the iteration whose checkpoint the interrupted run dies right after.
        checkpoints: whether the run has a checkpoint hook (without one nothing can resume).
        nproc: the processes per run (under ``torchrun ... -m expkit.check``: as many as it started).
        loggers: the ``logger`` settings by backend name.
        scratch: the scratch dir where the runs' work dirs (and an MLflow store) go.
        data_option: the ``data=`` option the config was composed with (None when unknown).
        data_class: the data module's class (``data._target_``).
    """

    steps_per_epoch: int
    budget: int
    kill_at: int
    checkpoints: bool
    nproc: int = 1
    loggers: dict[str, Any] = field(default_factory=dict)
    scratch: Path = Path()
    data_option: str | None = None
    data_class: str | None = None


def plan(cfg: DictConfig, nproc: int = 1) -> Plan:
    """The budget and the interruption point, from the train loader's length: by default an
    epoch and a half (the first epoch's end and its validation are crossed), killed halfway
    through the second epoch; never more than the run's own budget.

    Builds the data module to count the train loader's batches. ``check.iters`` and
    ``check.kill_at`` override the defaults.

    Args:
        cfg: the composed config (``check.yaml``: train.yaml's keys and ``check``).
        nproc: the processes per run; each rank then takes its share of every epoch.

    Returns:
        The plan (its ``scratch`` still unset).

    Raises:
        ConfigError: when ``trainer.seed`` is null, the budget is under 2 iterations, or
            ``check.kill_at`` is not inside the budget.
    """
    from hydra.core.hydra_config import HydraConfig

    from expkit.config.build import build_trainer_settings

    settings = build_trainer_settings(cfg)
    if settings.seed is None:
        raise ConfigError("trainer.seed is null: a run without a seed cannot be reproduced; set trainer.seed=0")
    steps = settings.steps_per_epoch(_train_batches(cfg, settings.seed, nproc))
    total = settings.max_iters or settings.max_epochs * steps  # type: ignore[operator]
    budget, kill_at = _budget_and_kill_at(cfg.check, steps, total)
    checkpoints = cfg.get("default_hooks", {}).get("checkpoint") is not None
    # a finding about the data names the option and the class, as the user would type them
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    the_plan = Plan(steps, budget, kill_at, checkpoints, nproc, _logger_settings(cfg))
    the_plan.data_option, the_plan.data_class = choices.get("data"), cfg.data.get("_target_")
    return the_plan


def _train_batches(cfg: DictConfig, seed: int, nproc: int) -> int:
    """The batches of one epoch of the train loader, on one rank (the data module is built for it)."""
    from expkit.config.build import instantiate_node
    from expkit.core.rng import seed_everything

    seed_everything(seed)
    data = instantiate_node(cfg.data, "data")
    loader = data.loaders()[0]
    batches = len(loader)
    # under torchrun each rank takes its share of every epoch (the sampler pads to equal shares)
    if nproc > 1 and getattr(loader, "batch_size", None):
        per_rank = math.ceil(len(loader.sampler) / nproc)
        batches = math.ceil(per_rank / loader.batch_size)
    return batches


def _budget_and_kill_at(check: DictConfig, steps: int, total: int) -> tuple[int, int]:
    """(iterations each run trains, the iteration the interrupted run is killed after): the
    ``check.iters`` and ``check.kill_at`` given, else an epoch and a half killed halfway
    through the second epoch (or halfway through a budget shorter than that)."""
    given = check.get("iters")
    budget = int(given) if given is not None else min(total, steps + max(2, steps // 2))
    if budget < 2:
        raise ConfigError(
            f"check.iters={budget}: the check needs at least 2 iterations (one before the "
            "interruption, one after); give check.iters=2 or more"
        )
    kill = check.get("kill_at")
    if kill is None:
        kill = steps + (budget - steps) // 2 if budget >= steps + 2 else max(1, budget // 2)
    kill = int(kill)
    if not 1 <= kill < budget:
        raise ConfigError(
            f"check.kill_at={kill}: the interruption must fall inside the budget, between 1 and "
            f"{budget - 1} (check.iters={budget})"
        )
    return budget, kill


def _logger_settings(cfg: DictConfig) -> dict[str, Any]:
    """The ``logger`` group's settings by backend name, unresolved (the dashboards are read back)."""
    from omegaconf import OmegaConf

    node = cfg.get("logger")
    given = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else {}
    return {k: v for k, v in (given or {}).items() if isinstance(v, dict)}  # type: ignore[union-attr]


def validate_settings(check: DictConfig) -> None:
    """Refuse, before anything trains, a ``check.`` setting the check does not have or cannot
    read, and a scratch dir or report path it cannot write in: three runs take minutes, and
    the report is written after them.

    Args:
        check: the composed ``check`` node.

    Raises:
        ConfigError: naming the setting and what to type instead.
    """
    unknown = [str(k) for k in check if k not in SETTINGS]
    if unknown:
        known = ", ".join(f"check.{k}" for k in SETTINGS)
        raise ConfigError(f"check.{unknown[0]}: the check has no such setting; its settings: {known}")
    for key in ("iters", "kill_at"):
        value = check.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"check.{key}={value}: give a number of iterations (e.g. check.{key}=40) or null")
    if not isinstance(check.get("keep"), bool):
        raise ConfigError(f"check.keep={check.get('keep')}: give check.keep=true or check.keep=false")
    scratch = check.get("dir")
    _writable(
        Path(str(scratch) if scratch is not None else tempfile.gettempdir()),
        f"check.dir={'null' if scratch is None else scratch}",
        "check.dir=<a directory you can write in>",
    )
    if check.get("out"):
        _writable(
            Path(str(check.out)).parent,
            f"check.out={check.out}",
            "check.out=<a path you can write to> (or check.out=null for no report)",
        )


def _writable(directory: Path, setting: str, instead: str) -> None:
    """Raise unless a file can be made in `directory`, or while it is missing in the nearest dir
    above it (tried with a file that is gone at once: nothing is left behind on bad input)."""
    there = directory.absolute()
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise ConfigError(f"{setting}: {there} is a file; give {instead}")
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot write in {there} ({exc.strerror or exc}); give {instead}") from None
