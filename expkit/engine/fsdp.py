"""``trainer.strategy=fsdp``: the model sharded with FSDP2, as ``devices`` wraps it for DDP.

Under torchrun, ``shard()`` applies PyTorch's FSDP2 (``fully_shard``) to the chosen blocks of
the model, then to the root, before the optimizer is built: every rank then holds 1/N of the
parameters, gradients and optimizer state. In one process nothing is sharded. The checkpoints
of such a run are ``expkit.checkpoint.dcp``'s (sharded in either case, so that a run can move
between 1 and N processes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from expkit.checkpoint.dcp import is_sharded
from expkit.core import activation_checkpointing as act_ckpt
from expkit.core import distributed
from expkit.core.errors import ConfigError

__all__ = ["DTYPES", "FORWARD_METHODS", "block_names", "check_hooks", "check_runner_inputs", "shard"]


FORWARD_METHODS = ("train_step", "eval_step", "generate")  # model methods that run like forward under FSDP2


def block_names(model: nn.Module, given: Iterable[str] | None) -> list[str]:
    """The module class names to shard one by one: `given` (``trainer.fsdp_blocks``), else the
    model's ``fsdp_blocks`` (or Hugging Face's ``_no_split_modules``), else the classes of the
    root's children that hold parameters.

    Args:
        model: the model to shard.
        given: the class names the config gives (``trainer.fsdp_blocks``); None: not given.

    Returns:
        The class names, in the order given or found.

    Raises:
        ConfigError: when `given` names a class the model does not contain.
    """
    if given is not None:
        names = [str(n) for n in given]
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(
                f"trainer.fsdp_blocks names {missing}, which the model does not contain; its module "
                f"classes are {sorted(present)}"
            )
        return names
    declared = getattr(model, "fsdp_blocks", None) or getattr(model, "_no_split_modules", None)
    if declared:
        return [str(n) for n in declared]
    return list(dict.fromkeys(type(c).__name__ for c in model.children() if any(True for _ in c.parameters())))


def check_hooks(hooks: Mapping[str, Any]) -> None:
    """Refuse, at start-up, the hooks that say they do not work with sharded parameters
    (``supports_sharding = False``): better than a failure, or a hang, later.

    Args:
        hooks: every hook of the run, by name.

    Raises:
        ConfigError: when a hook has ``supports_sharding = False``, naming each such hook.
    """
    refused = [
        f"{name} ({type(hook).__name__})"
        for name, hook in hooks.items()
        if not getattr(hook, "supports_sharding", True)
    ]
    if refused:
        raise ConfigError(
            f"trainer.strategy=fsdp: the hook(s) {', '.join(refused)} do not work with sharded parameters "
            "yet; remove them (hooks=[...] without them) or use trainer.strategy=ddp"
        )


DTYPES = {"bf16": torch.bfloat16, "32": torch.float32}  # trainer.fsdp_param_dtype / fsdp_reduce_dtype


def shard(
    model: nn.Module,
    blocks: Iterable[str] | None,
    device: torch.device,
    *,
    activation_checkpointing: str | Sequence[str] | None = None,
    compiled: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    offload: bool = False,
) -> nn.Module:
    """FSDP2 over `model` in place (on `device`): each module whose class is in the blocks
    (innermost first), then the root. The model's ``train_step`` / ``eval_step`` / ``generate``
    methods are registered as forward methods: calling them gathers the parameters as
    ``forward`` does (on every rank: a hook that calls the model must do so on all of them).

    Activation checkpointing wraps its blocks first, and a wrapped block is sharded as its wrapper
    (torchtitan's order): the all-gather stays outside the recomputed part.

    Args:
        model: the model to shard; moved to `device` and changed in place.
        blocks: the class names of the blocks (``trainer.fsdp_blocks``); None: found by ``block_names``.
        device: the device of this rank.
        activation_checkpointing: ``trainer.activation_checkpointing`` (None, ``"full"`` or class
            names), applied before sharding.
        compiled: whether the model will be compiled (``trainer.compile``), for activation checkpointing.
        param_dtype: ``trainer.fsdp_param_dtype``: the dtype the gathered parameters compute in
            (``bf16``, ``32``); the sharded master weights, the optimizer and checkpoints stay as they
            are. None: the parameters' own.
        reduce_dtype: ``trainer.fsdp_reduce_dtype``: the dtype gradients are reduce-scattered in;
            None: the compute dtype.
        offload: ``trainer.fsdp_offload``: keep the sharded parameters, gradients and optimizer state in
            (pinned) CPU memory, the optimizer stepping there; CUDA only.

    Returns:
        `model`, sharded.

    Raises:
        ConfigError: when the model owns its update (``train_step(batch, optimizers)``), `blocks` names a
            class the model does not contain, `offload` is asked on a device other than CUDA, or
            ``fully_shard`` fails on a module.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from expkit.optimizers import owns_its_update

    if owns_its_update(model):
        raise ConfigError(
            "a model that owns its update (train_step(batch, optimizers)) is not supported with "
            "trainer.strategy=fsdp yet; train it with trainer.strategy=ddp"
        )
    if offload and device.type != "cuda":
        raise ConfigError(
            f"trainer.fsdp_offload=true moves shards between CUDA and CPU memory; this run's device is "
            f"{device.type}: set trainer.fsdp_offload=false"
        )
    model = model.to(device)  # (with offload, fully_shard moves the shards to CPU memory)
    names = set(block_names(model, blocks))
    act_ckpt.apply(model, activation_checkpointing, blocks, compiled=compiled)
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[param_dtype] if param_dtype else None,
        reduce_dtype=DTYPES[reduce_dtype] if reduce_dtype else None,
    )
    options = {"mp_policy": policy, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    mesh = distributed.hold_mesh(init_device_mesh(device.type, (distributed.rank_and_world()[1],)))
    chosen = [
        (path, m)
        for path, m in model.named_modules()
        if act_ckpt.block_class(m) in names
        and m is not model
        and not path.endswith(act_ckpt.WRAPPED_STEP)  # a wrapped block: its wrapper is sharded
        and any(True for _ in m.parameters())
    ]
    for path, module in [*reversed(chosen), ("(the root)", model)]:  # pre-order reversed: inner blocks first
        try:
            fully_shard(module, mesh=mesh, **options)
        except Exception as exc:
            raise ConfigError(
                f"trainer.strategy=fsdp: could not shard {path} ({type(module).__name__}): "
                f"{type(exc).__name__}: {exc}. Choose other blocks with trainer.fsdp_blocks=[ClassName,...] "
                "(a module used in two places cannot be its own block), or use trainer.strategy=ddp"
            ) from None
    for method in FORWARD_METHODS:
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    return model


def check_runner_inputs(
    model: nn.Module, hooks: Mapping[str, Any] | Sequence[Any], default_hooks: Mapping[str, Any] | None
) -> None:
    """trainer.strategy=fsdp: the model is sharded under torchrun, and every hook works with it.

    Args:
        model: the model the runner is given.
        hooks: the hooks, by name or as a list (each named after its class).
        default_hooks: the default hooks by name; None: none.

    Raises:
        ConfigError: when the model is not sharded in a distributed run, or a hook does not support
            sharding.
    """
    if distributed.is_distributed() and not is_sharded(model):
        raise ConfigError(
            "trainer.strategy=fsdp under torchrun needs the model sharded before its optimizer is built: "
            "expkit.config.build does it; from Python, call expkit.engine.fsdp.shard(model, blocks, device) first"
        )
    named = list(hooks.items()) if isinstance(hooks, Mapping) else [(type(h).__name__, h) for h in hooks]
    check_hooks(dict(named, **(default_hooks or {})))
