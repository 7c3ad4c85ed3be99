"""Where the step runs: this process's device, batches moved to it, and the training step
as one module for DistributedDataParallel (``trainer.strategy=ddp``; FSDP2's sharding is
``expkit.engine.fsdp``'s)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from expkit.core import distributed
from expkit.core.settings import TrainerSettings

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["StepModule", "move", "precision", "run_device"]


def run_device(settings: TrainerSettings) -> torch.device:
    """The device of this process: ``trainer.device`` (auto: cuda when available), and under
    torchrun on GPUs, this rank's own GPU.

    Args:
        settings: the trainer settings; ``device`` is ``"auto"`` or a torch device name.

    Returns:
        The device; under a distributed run on CUDA, this rank's GPU (``distributed.cuda_index``) whatever index was given.
    """
    name = settings.device
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if distributed.is_distributed() and device.type == "cuda":
        device = torch.device("cuda", distributed.cuda_index())
    return device


def precision(name: str, device: torch.device) -> tuple[torch.dtype | None, Any]:
    """``trainer.precision`` (32, bf16, 16) as (the autocast dtype or None, a GradScaler or
    None): fp16 on CUDA scales the loss so small gradients do not underflow.

    Args:
        name: ``"32"``, ``"bf16"`` or ``"16"``.
        device: the run's device; a GradScaler is made only for CUDA.

    Returns:
        (None, None) for 32; (torch.bfloat16, None) for bf16; (torch.float16, a GradScaler on CUDA,
        else None) for 16.

    Raises:
        KeyError: when `name` is none of those.
    """
    dtype = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}[name]
    scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 and device.type == "cuda" else None
    return dtype, scaler


def move(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Tensors to `device` without waiting for the copy (from pinned memory it overlaps with
    compute); with `channels_last`, 4-D floating tensors (images) also change layout.

    Args:
        batch: a tensor, or a list, tuple or mapping of them (nested); anything else is returned as it is.
        device: the device to move the tensors to.
        channels_last: give 4-D floating-point tensors the channels-last memory format.

    Returns:
        The batch with its tensors on `device`: lists and tuples keep their type, mappings become dicts.
    """
    if isinstance(batch, torch.Tensor):
        if channels_last and batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, non_blocking=True, memory_format=torch.channels_last)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(b, device, channels_last) for b in batch)
    if isinstance(batch, Mapping):
        return {k: move(v, device, channels_last) for k, v in batch.items()}
    return batch


class StepModule(nn.Module):
    """The training step as a module, so DistributedDataParallel wraps the whole step,
    including a model's own train_step (gradients are averaged over ranks in backward).

    Args:
        runner: the run; its model becomes this module's only submodule, and its ``train_step`` is
            called when the model has none of its own.
    """

    def __init__(self, runner: Runner) -> None:
        super().__init__()
        self.model = runner.model
        self._runner = [runner]  # a list: not registered as a submodule

    def forward(self, data_batch: Any) -> dict[str, Any]:
        if hasattr(self.model, "train_step"):
            return self.model.train_step(data_batch)
        return self._runner[0].train_step(data_batch)
