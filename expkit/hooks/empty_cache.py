"""EmptyCacheHook: release cached CUDA memory at chosen points (NORMAL)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["EmptyCacheHook"]


class EmptyCacheHook(Hook):
    """``torch.cuda.empty_cache()`` before / after each train, val and test epoch and after
    each iteration, as chosen. Costs a synchronisation each time; a no-op without CUDA
    (``calls`` counts the points it reached).

    Args:
        before_epoch: empty the cache before each train, val and test epoch.
        after_epoch: empty the cache after each train, val and test epoch.
        after_iter: empty the cache after each train, val and test iteration (slow).
    """

    priority = Priority.NORMAL

    def __init__(self, before_epoch: bool = False, after_epoch: bool = True, after_iter: bool = False) -> None:
        self.before_epoch, self.after_epoch, self.after_iter = before_epoch, after_epoch, after_iter
        self.calls = 0

    def _empty(self, wanted: bool) -> None:
        if wanted:
            self.calls += 1
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def before_train_epoch(self, runner: Runner) -> None:
        self._empty(self.before_epoch)

    def before_val_epoch(self, runner: Runner) -> None:
        self._empty(self.before_epoch)

    def before_test_epoch(self, runner: Runner) -> None:
        self._empty(self.before_epoch)

    def after_train_epoch(self, runner: Runner) -> None:
        self._empty(self.after_epoch)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._empty(self.after_epoch)

    def after_test_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._empty(self.after_epoch)

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        self._empty(self.after_iter)

    def after_val_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        self._empty(self.after_iter)

    def after_test_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        self._empty(self.after_iter)
