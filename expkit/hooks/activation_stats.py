"""ActivationStatsHook: mean and spread of chosen layers' outputs every N iterations (NORMAL)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.activation_checkpointing import parameter_name
from expkit.core.stages import Priority
from expkit.hooks._probes import OutputProbe, leaf_modules
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["ActivationStatsHook"]


class ActivationStatsHook(Hook):
    """Every ``interval`` iterations, records ``activations/<layer>/mean`` and ``/std`` of the
    named modules' outputs (``layers``: names as in ``model.named_modules()``; None: every
    leaf module that has parameters) for the log record. Forward hooks are attached only for
    the iterations that are measured.

    Args:
        layers: the names of the modules to measure, as in ``model.named_modules()``; None: every leaf
            module that has parameters. A name the model lacks fails at the start of training.
        interval: the iterations between measurements (the ``interval``-th, 2 * ``interval``-th, ...
            iteration of the run); at least 1.

    Raises:
        ValueError: `interval` is below 1.
    """

    priority = Priority.NORMAL

    def __init__(self, layers: Sequence[str] | None = None, interval: int = 50) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.layers = list(layers) if layers is not None else None
        self.interval = interval
        self._probe: OutputProbe | None = None
        self.latest: dict[str, float] = {}

    def before_train(self, runner: Runner) -> None:
        # named as without activation checkpointing: a wrapped block's name is the block's own
        modules = {parameter_name(n): m for n, m in runner.model.named_modules()}
        if self.layers is None:
            self._targets = {n: m for n, m in leaf_modules(runner.model).items() if list(m.parameters())}
        else:
            missing = [n for n in self.layers if n not in modules]
            if missing:
                raise ValueError(f"layers {missing} are not in the model; it has: {', '.join(n for n in modules if n)}")
            self._targets = {n: modules[n] for n in self.layers}

    def before_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any) -> None:
        if self.every_n_train_iters(runner, self.interval):
            self._probe = OutputProbe(self._targets, self._record)

    def _record(self, name: str, output: torch.Tensor) -> None:
        out = output.detach().float()
        self.latest[f"activations/{name}/mean"] = float(out.mean())
        self.latest[f"activations/{name}/std"] = float(out.std()) if out.numel() > 1 else 0.0

    def after_forward(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
            runner.extra_scalars.update(self.latest)
