"""GradNormHook: log the gradients' total L2 norm (ABOVE_NORMAL)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["GradNormHook"]


class GradNormHook(Hook):
    """Every ``interval`` iterations, after backward (and before clipping), publishes
    ``train/grad_norm``: the L2 norm of all gradients together, as clip_grad_norm_ sees it.
    With fp16 the gradients are still scaled there, so the scale is divided out.

    Args:
        interval: the iterations between measurements (the ``interval``-th, 2 * ``interval``-th, ...
            iteration of the run); at least 1.

    Raises:
        ValueError: `interval` is below 1.
    """

    priority = Priority.ABOVE_NORMAL

    def __init__(self, interval: int = 10) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval

    def after_backward(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if not self.every_n_train_iters(runner, self.interval):
            return
        grads = [p.grad.detach() for p in runner.model.parameters() if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if runner.scaler is not None:
            norm = norm / runner.scaler.get_scale()
        runner.extra_scalars["train/grad_norm"] = float(norm)
