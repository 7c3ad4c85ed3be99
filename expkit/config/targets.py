"""The ``_target_`` checks that need no object built: the target imports, and a number argument
is given a finite number. ``expkit.config.build`` runs them before it instantiates a node; a
sweep runs them on every job's swept values before any job starts (``check_swept_values``), so
a typo in a grid's last value fails the sweep at once, not hours later when its job runs.

Light on purpose: importing it imports no torch and no Runner, since the sweeper's own process
imports it (on a cluster, the login node's). What a check needs is imported when it runs: a
target's module (often torch) for a swept key under it, the trainer settings for a swept
``trainer`` key.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from expkit.core.errors import ConfigError
from expkit.core.hydra_compat import locate

if TYPE_CHECKING:
    from expkit.core.settings import TrainerSettings

__all__ = ["build_trainer_settings", "check_numbers", "check_swept_values", "locate_target"]

_RESERVED = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def locate_target(node: DictConfig, key: str) -> Any:
    """The object `node`'s ``_target_`` names, imported.

    Args:
        node: a config node with a ``_target_``.
        key: the node's config key, named in the error.

    Returns:
        The class or function.

    Raises:
        ConfigError: when the target cannot be imported, with the import's own reason.
    """
    target = node.get("_target_")
    try:
        return locate(target)
    except Exception as exc:  # ImportError, AttributeError, ...
        cause = exc.__cause__ or exc
        raise ConfigError(
            f"{key}._target_={target!r} cannot be imported ({type(cause).__name__}: {cause}). "
            "Check the spelling, and that its package is installed or on PYTHONPATH."
        ) from None


def check_numbers(target: Any, node: DictConfig, key: str, names: Iterable[str] | None = None) -> None:
    """A string where the target's default is a number (optim.lr=abc), or a value that is not
    finite (lr=nan trains nothing and "completes"), fails here, by name.

    Args:
        target: the class or function the node builds (its signature's defaults are read).
        node: the config node.
        key: the node's config key, named in the error.
        names: the arguments to check; None: every one the node gives. An interpolation among
            them is not resolved (it may need the run: ``${data_info:...}``) and is not checked,
            nor is a missing value (``???``).

    Raises:
        ConfigError: naming ``<key>.<argument>``, its value, and a number to type instead.
    """
    params = _parameters(target)
    # (every argument: as the node's items give them, a missing value as "???", left to the build's
    # own words; named ones: an interpolation or a missing value is not read)
    for name, value in node.items() if names is None else ((name, None) for name in names):
        name = str(name)
        if name in _RESERVED or name not in params or name not in node:
            continue
        if names is not None:
            if OmegaConf.is_interpolation(node, name) or OmegaConf.is_missing(node, name):
                continue
            value = node[name]
        default = params[name].default
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if isinstance(value, float) and not math.isfinite(value):
            example = f", e.g. {key}.{name}={default}" if numeric and math.isfinite(default) else ""
            raise ConfigError(f"{key}.{name}={value} is not a finite number; give one{example}")
        if isinstance(value, str) and numeric:
            raise ConfigError(f"{key}.{name}={value!r} is not a number; give one, e.g. {key}.{name}={default}")


def _parameters(target: Any) -> dict[str, inspect.Parameter]:
    """The named parameters `target` takes: its signature's, and for a class whose ``__init__``
    passes ``**kwargs`` on, those of the bases' ``__init__`` it passes them to (``DigitsData``'s
    ``batch_size`` and ``num_workers`` are ``DataModule``'s); empty when there is no signature."""
    try:
        params = dict(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return {}
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for base in target.__mro__[1:] if inspect.isclass(target) else ():
        if not passes_on or base is object:
            break
        if "__init__" not in vars(base):
            continue
        try:
            more = inspect.signature(base.__init__).parameters
        except (TypeError, ValueError):
            break
        for name, param in list(more.items())[1:]:  # (not self)
            if param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                params.setdefault(name, param)
        passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in more.values())
    return params


def build_trainer_settings(cfg: DictConfig) -> TrainerSettings:
    """``cfg.trainer`` as TrainerSettings; a bad value raises a ConfigError naming ``trainer.<key>``.

    Args:
        cfg: the composed config; its ``trainer`` node is read, resolved.

    Returns:
        The trainer settings.

    Raises:
        ConfigError: when ``TrainerSettings`` refuses a key or value with a TypeError.
    """
    import dataclasses
    import difflib

    from expkit.core.settings import TrainerSettings

    fields = OmegaConf.to_container(cfg.trainer, resolve=True)
    known = [f.name for f in dataclasses.fields(TrainerSettings)]
    for key in fields:  # type: ignore[union-attr]
        if key not in known:  # (a key added with +trainer.KEY=...)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean trainer.{close[0]}?" if close else "see --cfg job for the trainer's keys"
            raise ConfigError(f"trainer.{key} is not a trainer setting; {hint}")
    try:
        return TrainerSettings(**fields)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError(f"trainer: {exc}") from None


def check_swept_values(config: DictConfig, overrides: Sequence[str], imports_here: bool = True) -> None:
    """What `overrides` set in one sweep job's composed `config`, checked as the job's run checks
    before building: the node a run builds through ``expkit.config.build`` (the outermost with a
    ``_target_`` on the key's path: ``optim``, ``model``, ``hooks.ema``, ``sched.scheduler``; Hydra
    builds the nodes inside it unchecked) imports, and a value given to one of its arguments whose
    default is a number is a finite number (``optim.lr=abc``, ``optim.lr=nan``,
    ``optim._target_=torch.optim.Sgd``); a job that sets a ``trainer`` key gets its trainer
    settings built (``trainer.max_epochs=abc``).

    Args:
        config: the job's composed config.
        overrides: the job's overrides, as Hydra's override grammar writes them.
        imports_here: whether this process imports what the job will (the jobs run in it): a
            target that does not import is refused. False (a launcher that runs the jobs elsewhere,
            whose environment may differ): such a target is left to the job, and what imports is
            still checked.

    Raises:
        ConfigError: the first value the job's run would refuse, with that run's message.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # (Hydra's composition said what is wrong with them already)
        return
    for override in parsed:
        if override.is_delete() or override.key_or_group.startswith("hydra."):  # (Hydra's own: it checks them)
            continue
        parts = override.key_or_group.split("@")[0].split(".")
        if parts[-1] == "_target_":
            parts = parts[:-1]
        for depth in range(1, len(parts) + 1):
            key = ".".join(parts[:depth])
            node = OmegaConf.select(config, key, throw_on_resolution_failure=False)
            if not isinstance(node, DictConfig) or "_target_" not in node:
                continue
            try:
                target = locate_target(node, key)
            except ConfigError:
                if imports_here:
                    raise
                break
            given = override.value()
            if depth == len(parts) - 1:  # one argument
                check_numbers(target, node, key, names=[parts[-1]])
            elif depth == len(parts) and isinstance(given, dict):  # the node given whole: its arguments
                check_numbers(target, node, key, names=[str(name) for name in given])
            break
    if "trainer" in config and any(o.key_or_group.split(".")[0] == "trainer" for o in parsed if not o.is_delete()):
        try:
            build_trainer_settings(config)
        except OmegaConfBaseException:  # (an interpolation only the run resolves: left to it)
            pass
