"""``trainer.activation_checkpointing``: keep only the inputs of a model's blocks in the forward
pass and compute the rest again in backward, trading time for the memory of activations.

Each chosen block is wrapped in torch's ``checkpoint_wrapper`` (``torch.utils.checkpoint``,
non-reentrant, with the RNG state kept: dropout draws the same masks when recomputed, so the
losses are the same). The wrapper takes the block's place, so module and parameter paths gain a
``_checkpoint_wrapped_module.`` step; its state-dict hooks keep the ``state_dict()`` keys as they
were (torch's distributed state dicts drop the step too, and ``parameter_name`` here does for
expkit's own names), so checkpoints move between runs with and without it.

Why a wrapper: torch's composable ``checkpoint`` (forward hooks, no wrapper) would keep the paths
too, but ``torch.compile`` cannot replay it: the recomputed block differs from the compiled one and
backward fails (CheckpointError, torch 2.14), so ``trainer.compile`` could not be used with it.

A recomputed forward would update BatchNorm's running statistics a second time (eager mode; the
compiled checkpoint applies a block's buffer updates once): a block with BatchNorm gets them back
after its recomputation. Other buffers a block's forward changes would change twice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from expkit.core.errors import ConfigError

__all__ = ["KEY", "WRAPPED_STEP", "apply", "block_class", "parameter_name"]

log = logging.getLogger("expkit")

KEY = "trainer.activation_checkpointing"
# the step a wrapper adds to paths (torch's _CHECKPOINT_WRAPPED_MODULE; a test checks they agree),
# written out so that reading a name does not import torch.distributed
WRAPPED_STEP = "_checkpoint_wrapped_module"
_WRAPPED = WRAPPED_STEP + "."


def parameter_name(name: str) -> str:
    """A parameter's (or module's) path as it is without activation checkpointing, which is also
    its ``state_dict()`` key: ``h.0._checkpoint_wrapped_module.mlp.weight`` -> ``h.0.mlp.weight``.

    Args:
        name: a path from ``named_parameters()``, ``named_buffers()`` or ``named_modules()``.

    Returns:
        The path without the wrappers' steps.
    """
    return name.replace(_WRAPPED, "") if _WRAPPED in name else name


def block_class(module: nn.Module) -> str:
    """The class name of a module, or of the block a checkpoint wrapper holds.

    Args:
        module: any module.

    Returns:
        Its class name, or for a wrapper the class name of the wrapped block.
    """
    inner = module._modules.get(WRAPPED_STEP)
    return type(inner if inner is not None else module).__name__


def _classes(model: nn.Module) -> list[str]:
    """The class names of the modules below the root, in order of first appearance."""
    return list(dict.fromkeys(block_class(m) for m in model.modules() if m is not model))


def _repeated_children(model: nn.Module) -> list[str]:
    """The classes that appear at least twice, with parameters, among the items of a ModuleList or
    Sequential: a stack of blocks (GPT-2's ``h``, a ResNet stage, an MLP's layers)."""
    found: dict[str, None] = {}
    for parent in model.modules():
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        counts: dict[str, int] = {}
        for child in parent.children():
            if any(True for _ in child.parameters()):
                counts[block_class(child)] = counts.get(block_class(child), 0) + 1
        found.update((name, None) for name, n in counts.items() if n >= 2)
    return list(found)


def _blocks(model: nn.Module, setting: str | Sequence[str], fsdp_blocks: Iterable[str] | None) -> list[str]:
    """The block classes a setting names: its list, or for ``full`` ``trainer.fsdp_blocks``, else
    the model's own list (``fsdp_blocks``, Hugging Face's ``_no_split_modules``), else the repeated
    children. Raises ConfigError naming the classes the model has when a name is not among them."""
    present = _classes(model)
    declared = getattr(model, "fsdp_blocks", None) or getattr(model, "_no_split_modules", None) or ()
    own = [n for n in map(str, declared) if n in present] or _repeated_children(model)
    blocks = ", ".join(own) if own else "none found"
    if setting == "full" and fsdp_blocks is None:
        if not own:
            raise ConfigError(
                f"{KEY}=full: the model names no blocks (fsdp_blocks, _no_split_modules) and has no repeated "
                f"children; name them: {KEY}=[ClassName,...] (its module classes: {', '.join(present)})"
            )
        return own
    key, names = (KEY, list(setting)) if setting != "full" else ("trainer.fsdp_blocks", list(fsdp_blocks or ()))
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            f"{key} names {', '.join(missing)}, which the model does not have; its blocks: {blocks} "
            f"(type {KEY}=full for those, or {KEY}=[ClassName,...] from its module classes: {', '.join(present)})"
        )
    return names


@contextlib.contextmanager
def _running_stats_kept(norms: Sequence[nn.Module]) -> Iterator[None]:
    """The BatchNorm layers' running statistics as they were before the block was recomputed."""
    saved = [[b.clone() for b in norm.buffers()] for norm in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, buffers in zip(norms, saved):
                for buffer, value in zip(norm.buffers(), buffers):
                    buffer.copy_(value)


def _contexts(
    norms: Sequence[nn.Module],
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's ``context_fn``: (around the forward, around its recomputation)."""
    return contextlib.nullcontext(), _running_stats_kept(norms)


def _wrapper(block: nn.Module, compiled: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    norms = [
        m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
    ]
    if not norms or compiled:  # (torch.compile takes no context_fn but its own modes)
        return checkpoint_wrapper(block)
    return checkpoint_wrapper(block, context_fn=functools.partial(_contexts, norms))


def apply(
    model: nn.Module,
    setting: str | Sequence[str] | None,
    fsdp_blocks: Iterable[str] | None = None,
    *,
    compiled: bool = False,
) -> list[str]:
    """Wrap the model's blocks for activation checkpointing, in place: every module of a chosen
    class (not the root, and not one inside another chosen block). Nothing happens when `setting`
    is None or the model is wrapped already (``expkit.engine.fsdp.shard`` wraps before
    sharding, then the Runner finds it done).

    Args:
        model: the model; its blocks are replaced by their wrappers.
        setting: ``trainer.activation_checkpointing``: None (off), ``"full"`` or a list of class names.
        fsdp_blocks: ``trainer.fsdp_blocks``, the blocks ``full`` means when given.
        compiled: whether the model will run under ``torch.compile`` (``trainer.compile``).

    Returns:
        The paths of the blocks wrapped now.

    Raises:
        ConfigError: when a name is not a class of the model, ``full`` finds no blocks, or the model
            was sharded by FSDP2 without it (the wrappers must come first).
    """
    if setting is None:
        return []
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
        return []
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise ConfigError(
            f"{KEY}: the model was sharded without it; wrap the blocks first: "
            "expkit.engine.fsdp.shard(model, blocks, device, activation_checkpointing=...)"
        )
    names = set(_blocks(model, setting, fsdp_blocks))
    chosen: list[str] = []
    for path, module in model.named_modules():
        inside = any(path.startswith(f"{outer}.") for outer in chosen)
        if module is not model and type(module).__name__ in names and not inside:
            chosen.append(path)
    for path in chosen:
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attribute, _wrapper(parent.get_submodule(attribute), compiled))
    log.info("Activation checkpointing: %d blocks (%s)", len(chosen), ", ".join(sorted(names)))
    return chosen
