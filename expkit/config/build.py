"""Config -> objects. The only module that calls ``hydra.utils.instantiate``.

Every error names the config key and says what to type instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from expkit.config.targets import build_trainer_settings, check_numbers, locate_target
from expkit.core import distributed
from expkit.core.data_info import DATA_INFO
from expkit.core.errors import ConfigError, ExpkitError
from expkit.core.hydra_compat import instantiate
from expkit.core.param_groups import build_param_groups
from expkit.core.rng import seed_everything
from expkit.core.stages import get_priority
from expkit.data import DataModule
from expkit.data.inputs import fingerprint_inputs
from expkit.engine.devices import run_device
from expkit.engine.runner import Runner
from expkit.hooks.base import Hook
from expkit.loggers.backends import Backend
from expkit.metrics import MetricSlot
from expkit.models import submodule

__all__ = [
    "build_hook",
    "build_loggers",
    "build_metrics",
    "build_model",
    "build_optimizers",
    "build_runner",
    "build_trainer_settings",
    "describe_data",
    "instantiate_node",
]


log = logging.getLogger("expkit")


def instantiate_node(node: Any, key: str, **kwargs: Any) -> Any:
    """Instantiate a config node that has a ``_target_``; errors name ``key``.

    Args:
        node: the config node to build.
        key: the node's config key, named in error messages.
        **kwargs: extra keyword arguments for the target, passed to ``instantiate``.

    Returns:
        What the target built.

    Raises:
        ConfigError: when `node` is not a dict node with a ``_target_``, the target cannot be imported,
            a number argument is given a string or a non-finite value, or building it fails (an
            ExpkitError the target raises is raised as it is).
    """
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"{key} needs a _target_ (the import path of what to build), got {node!r}")
    target = locate_target(node, key)
    check_numbers(target, node, key)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ExpkitError):
            raise cause from None
        detail = f"{type(cause).__name__}: {cause}" if cause else str(exc)
        raise ConfigError(f"{key} ({node._target_}) could not be built: {detail}") from None
    except ExpkitError:
        raise
    except Exception as exc:  # Hydra 1.4 lets the target's own error through (1.3 wrapped it, above)
        raise ConfigError(f"{key} ({node._target_}) could not be built: {type(exc).__name__}: {exc}") from None


def _accepted(target: Any, names: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `names` that `target` takes as keyword arguments."""
    func = target.func if isinstance(target, functools.partial) else target
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in names.items() if k in params}


def build_hook(node: Any, key: str) -> Hook:
    """A hook from its config node; a ``priority:`` key beats the class attribute.

    Args:
        node: the hook's config node; not changed (a copy loses ``priority``).
        key: the node's config key, named in error messages.

    Returns:
        The hook, its ``priority`` set from the node when the node gives one.

    Raises:
        ConfigError: when the priority is not a level name or an integer 0-100, building fails, or the
            target builds something that is not a Hook.
    """
    node = node.copy()
    priority = None
    if isinstance(node, DictConfig) and "priority" in node:
        with open_dict(node):
            priority = node.pop("priority")
        try:
            priority = get_priority(priority)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}.priority: {exc}") from None
    hook = instantiate_node(node, key)
    if not isinstance(hook, Hook):
        raise ConfigError(f"{key}._target_={node._target_} builds a {type(hook).__name__}, not an expkit.Hook subclass")
    if priority is not None:
        hook.priority = priority  # type: ignore[misc]
    return hook


def _no_target(key: str, name: str, node: Any) -> None:
    """A hook or backend entry that builds nothing: keys set (``+hooks.ema.priority=HIGH``, or an
    experiment's ``hooks.ema.momentum``) for an option this run does not pick. Said in the log,
    where the run's record is, with both ways out; the run goes on without it."""
    given = OmegaConf.to_yaml(node).strip().replace("\n", "; ") if isinstance(node, DictConfig) else repr(node)
    use = f"'{key}=[{name}]'" if key in ("hooks", "logger") else "its _target_"
    log.warning(
        "%s.%s has no _target_, so nothing is built from it (%s): to use it, give %s; to silence "
        "this, drop its keys with '~%s.%s'",
        key,
        name,
        given,
        use,
        key,
        name,
    )


def _build_hooks(nodes: Any, key: str) -> dict[str, Hook]:
    hooks: dict[str, Hook] = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            _no_target(key, str(name), node)
            continue
        try:
            hooks[str(name)] = build_hook(node, f"{key}.{name}")
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{key}.{name}: {exc}") from None
    return hooks


def build_loggers(nodes: Any, key: str) -> dict[str, Backend]:
    """The logging backends of config node `key` (``logger``), by name; an unknown one names the key.

    Args:
        nodes: the ``logger`` node, backend configs by name; None entries are skipped, and entries
            without a ``_target_`` skipped with a warning.
        key: the node's config key, named in error messages.

    Returns:
        The backends by name.

    Raises:
        ConfigError: when a backend cannot be built, or its target builds something that is not a Backend.
    """
    loggers: dict[str, Backend] = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            _no_target(key, str(name), node)
            continue
        backend = instantiate_node(node, f"{key}.{name}")
        if not isinstance(backend, Backend):
            raise ConfigError(
                f"{key}.{name}._target_={node._target_} builds a {type(backend).__name__}, "
                "not an expkit.loggers.backends.Backend"
            )
        loggers[str(name)] = backend
    return loggers


def describe_data(data: Any) -> dict[str, Any]:
    """What the data module tells models: its ``describe()``, or the image attributes of an
    object that has no such method.

    Args:
        data: the data module.

    Returns:
        ``data.describe()`` as a dict; without that method, those of ``DataModule.IMAGE_KEYS`` that
        `data` has as attributes.
    """
    if callable(getattr(data, "describe", None)):
        return dict(data.describe())
    return {k: getattr(data, k) for k in DataModule.IMAGE_KEYS if hasattr(data, k)}


def build_model(cfg: DictConfig, data: Any) -> Any:
    """The model of `cfg`. What the data module describes (``in_channels``, ``num_classes``,
    ``vocab_size``, ...) fills the model's arguments of those names that the config leaves
    unset, and is available to any config value as ``${data_info:KEY}``.

    Args:
        cfg: the composed config; its ``model`` node is built.
        data: the data module, whose description fills the model's arguments and ``DATA_INFO``.

    Returns:
        The model; a bare Hugging Face ``PreTrainedModel`` comes wrapped in ``HFModel``.

    Raises:
        ConfigError: when the model's target cannot be imported or building it fails.
    """
    info = describe_data(data)
    DATA_INFO.clear()
    DATA_INFO.update(info)
    model_target = locate_target(cfg.model, "model")
    model_kwargs = {k: v for k, v in _accepted(model_target, info).items() if cfg.model.get(k) is None}
    model = instantiate_node(cfg.model, "model", **model_kwargs)
    if type(model).__module__.startswith("transformers."):  # a bare PreTrainedModel: dict batches, its own loss
        from expkit.tasks.hf import HFModel, is_transformers_model

        if is_transformers_model(model):
            model = HFModel(model, info.get("tokenizer_json"))
    return model


_SLOT_KEYS = ("inputs", "higher_is_better")  # expkit's keys in a metric's node, not the metric's arguments


def build_metrics(nodes: Any, key: str = "metrics") -> dict[str, MetricSlot]:
    """``metrics.<name>``: any object with update/compute/reset (torchmetrics included), plus
    expkit's ``inputs`` (which eval-step outputs it reads) and ``higher_is_better`` (its direction).

    Args:
        nodes: the ``metrics`` node, metric configs by name; None entries are skipped.
        key: the node's config key, named in error messages.

    Returns:
        The metric slots by name.

    Raises:
        ConfigError: when a metric has no ``_target_``, cannot be built, or its slot settings are invalid.
    """
    slots: dict[str, MetricSlot] = {}
    for name, node in (nodes or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"{key}.{name} needs a _target_, e.g. {key}.{name}="
                "{_target_: torchmetrics.classification.MulticlassF1Score, num_classes: 10}"
            )
        node = node.copy()
        with open_dict(node):
            extra = {k: node.pop(k) for k in _SLOT_KEYS if k in node}
        inputs = extra.get("inputs")
        if inputs is not None:
            inputs = OmegaConf.to_container(inputs) if isinstance(inputs, (DictConfig, ListConfig)) else inputs
        slots[str(name)] = MetricSlot(
            instantiate_node(node, f"{key}.{name}"), f"{name}", inputs, extra.get("higher_is_better")
        )
    return slots


def _build_optimizer(node: DictConfig, module: Any, key: str) -> Any:
    """One optimizer over `module`'s parameters (grouped by ``param_groups`` rules, if any)."""
    node = node.copy()
    with open_dict(node):
        rules = node.pop("param_groups", None)  # expkit's keys, not the optimizer's arguments
        node.pop("module", None)
    factory = instantiate_node(node, key)
    params: Any = module.parameters()
    if rules:
        params = build_param_groups(module, OmegaConf.to_container(rules, resolve=True), factory, f"{key}.param_groups")  # type: ignore[arg-type]
    try:
        return factory(params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} ({node._target_}): {exc}") from None


def build_optimizers(optim: DictConfig, model: Any) -> dict[str, Any]:
    """``optim`` with a ``_target_``: one optimizer over the model (named "optimizer").
    Without: named optimizers, ``optim.<name>: {_target_: ..., module: <submodule path>}``,
    each over its submodule's parameters (the whole model when ``module`` is unset), for a
    model whose ``train_step(batch, optimizers)`` uses them.

    Args:
        optim: the ``optim`` node.
        model: the model whose parameters (or submodules' parameters) the optimizers update.

    Returns:
        The optimizers by name (one named ``"optimizer"`` when `optim` has a ``_target_``).

    Raises:
        ConfigError: when a named optimizer has no ``_target_``, its ``module`` is not a submodule of the
            model, building it fails, or `optim` defines no optimizer.
    """
    if "_target_" in optim:
        return {"optimizer": _build_optimizer(optim, model, "optim")}
    optimizers = {}
    for name, node in optim.items():
        key = f"optim.{name}"
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"{key} needs a _target_: optim is one optimizer ({{_target_: torch.optim.AdamW, ...}}) "
                "or named ones, each with its _target_ and the model's submodule it updates (module:)"
            )
        module = submodule(model, str(node.get("module") or ""), f"{key}.module")
        optimizers[str(name)] = _build_optimizer(node, module, key)
    if not optimizers:
        raise ConfigError("optim defines no optimizer: give optim=sgd (or adam, adamw) or named optimizers")
    return optimizers


def build_runner(cfg: DictConfig, work_dir: str | Path, run_info: Mapping[str, Any] | None = None) -> Runner:
    """Everything the run needs, from the composed config, handed to a Runner.

    Args:
        cfg: the composed config.
        work_dir: the run directory.
        run_info: what the command knows of the run (its command line, the sweep job), handed to the
            Runner; None: nothing.

    Returns:
        The Runner, with the data, model, optimizers, schedulers, criterion, metrics, hooks and loggers
        built (and the seed set first when ``trainer.seed`` is given).

    Raises:
        ConfigError: when a part cannot be built, or a config value is missing or invalid.
    """
    try:
        return _build_runner(cfg, work_dir, run_info)
    except MissingMandatoryValue as exc:
        key = exc.full_key
        raise ConfigError(f"{key} is required and has no value: add {key}=... to the command line") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc.full_key}: {exc.msg}") from None


def _build_runner(cfg: DictConfig, work_dir: str | Path, run_info: Mapping[str, Any] | None) -> Runner:
    settings = build_trainer_settings(cfg)
    if settings.fsdp_offload and run_device(settings).type != "cuda":  # (before the data and model are built)
        raise ConfigError(
            "trainer.fsdp_offload=true moves shards between CUDA and CPU memory, and this run's device is "
            f"{run_device(settings)} (trainer.device={settings.device}): set trainer.fsdp_offload=false"
        )
    if settings.seed is not None:
        seed_everything(settings.seed)  # before building: model init and data splits depend on it

    data = instantiate_node(cfg.data, "data")
    train_loader, val_loader, test_loader = data.loaders()
    model = build_model(cfg, data)
    data_info = dict(DATA_INFO)  # (build_model filled it)
    # what the run reads, for provenance.json (rank 0 writes it): the digits' CSV is hashed in well under 1 ms
    inputs = fingerprint_inputs(data, (train_loader, val_loader, test_loader)) if distributed.is_main() else None
    default_hooks, hooks = _build_hooks(cfg.default_hooks, "default_hooks"), _build_hooks(cfg.hooks, "hooks")
    if settings.strategy == "fsdp":
        from expkit.engine import fsdp

        fsdp.check_hooks({**hooks, **default_hooks})  # before sharding: a refused hook is the clearer error
        if distributed.is_distributed():  # before the optimizer: it holds the shards
            model = fsdp.shard(
                model,
                settings.fsdp_blocks,
                run_device(settings),
                activation_checkpointing=settings.activation_checkpointing,  # (wrapped before sharded)
                compiled=settings.compile,
                param_dtype=settings.fsdp_param_dtype,
                reduce_dtype=settings.fsdp_reduce_dtype,
                offload=settings.fsdp_offload,
            )

    optimizers = build_optimizers(cfg.optim, model)
    schedulers = {}
    if cfg.sched.get("scheduler") is not None:  # one scheduler per optimizer
        steps_per_epoch = settings.steps_per_epoch(len(train_loader))  # optimizer steps
        total = settings.max_iters or settings.max_epochs * steps_per_epoch  # type: ignore[operator]
        if cfg.sched.by_epoch:
            total = settings.max_epochs or -(-total // steps_per_epoch)
        factory = instantiate_node(cfg.sched.scheduler, "sched.scheduler")
        extra = _accepted(factory, {"total_steps": total, "steps_per_epoch": steps_per_epoch})
        for name, optimizer in optimizers.items():
            try:
                schedulers[name] = factory(optimizer, **extra)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"sched.scheduler ({cfg.sched.scheduler._target_}): {exc}") from None
    named = "_target_" not in cfg.optim  # optim: {generator: {...}, discriminator: {...}}

    criterion = instantiate_node(cfg.criterion, "criterion")
    metrics = build_metrics(cfg.metrics)

    return Runner(
        model=model,
        optimizer=optimizers if named else optimizers["optimizer"],
        train_loader=train_loader,
        val_loader=val_loader,
        test_loader=test_loader,
        scheduler=schedulers if named else schedulers.get("optimizer"),
        scheduler_by_epoch=bool(cfg.sched.by_epoch),
        criterion=criterion,
        metrics=metrics,
        monitor=cfg.get("monitor"),
        settings=settings,
        default_hooks=default_hooks,
        hooks=hooks,
        loggers=build_loggers(cfg.get("logger"), "logger"),
        work_dir=work_dir,
        resume=cfg.resume,
        load_from=cfg.load_from,
        config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
        run_info=run_info,
        data_info=data_info,
        inputs=inputs,
    )
