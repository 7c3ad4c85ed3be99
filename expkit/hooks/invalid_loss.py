"""InvalidLossHook: stop at the first NaN or infinite loss, before it reaches the weights (HIGHEST)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from expkit.core.errors import ExpkitError
from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["InvalidLossError", "InvalidLossHook"]


class InvalidLossError(ExpkitError):
    """The training loss is not finite."""


class InvalidLossHook(Hook):
    """Checks the loss right after the forward pass, every ``interval`` iterations, and fails
    the run with the epoch and iteration when it is NaN or infinite: the weights never take
    that step, and the last checkpoint stays the last good one. Each check reads the loss
    (a host-device synchronisation on a GPU: raise ``interval`` there).

    Args:
        interval: the iterations between checks (the ``interval``-th, 2 * ``interval``-th, ... iteration
            of the run); 1 checks every iteration. At least 1.

    Raises:
        ValueError: `interval` is below 1.
    """

    priority = Priority.HIGHEST

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval

    def after_forward(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if not self.every_n_train_iters(runner, self.interval):
            return
        loss = outputs["loss"].detach()
        if not bool(torch.isfinite(loss).all()):
            good = f"; the last good checkpoint is {runner.last_checkpoint}" if runner.last_checkpoint else ""
            raise InvalidLossError(
                f"the training loss is {loss.float().mean().item()} at epoch {runner.epoch + 1}, "
                f"iteration {runner.iter + 1}{good}. Lower optim.lr, or set trainer.clip_grad_norm."
            )
