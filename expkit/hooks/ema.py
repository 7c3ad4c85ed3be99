"""EMAHook: an exponential moving average of the weights, used for validation and test (NORMAL).

Checkpoints keep both, under explicit keys: ``state_dict`` is always the raw (trained)
weights, ``ema_state_dict`` the averaged ones. Nothing is swapped behind your back.
Costs one extra copy of the parameters (and of the buffers with ``update_buffers``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.activation_checkpointing import parameter_name
from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["EMA_TYPES", "EMAHook"]


EMA_TYPES = ("ExponentialMovingAverage", "StochasticWeightAverage", "MomentumAnnealingEMA")


class EMAHook(Hook):
    """Averages the weights after each optimizer step.

    ``momentum``: weight of the new value, ``ema = (1 - momentum) * ema + momentum * w``
    (MMEngine's convention; torch's "decay" is ``1 - momentum``).
    ``ema_type``: ExponentialMovingAverage; StochasticWeightAverage (equal weights);
    MomentumAnnealingEMA (momentum ``max(momentum, gamma / (gamma + steps))``).
    ``interval``: average every n iterations. ``begin_iter``/``begin_epoch``: before that,
    the average just follows the weights. ``update_buffers``: average buffers too
    (BatchNorm statistics); otherwise validation uses the model's own buffers.

    Args:
        momentum: the weight of the new weights in each update, in (0, 1); the average spans about
            1 / `momentum` updates. The default is MMEngine's.
        ema_type: ``ExponentialMovingAverage`` (weight `momentum`), ``StochasticWeightAverage`` (weight
            1 / (k + 1), k the optimizer steps so far divided by `interval`, counted from the run's first
            step) or ``MomentumAnnealingEMA`` (weight ``max(momentum, gamma / (gamma + steps))``).
        interval: the optimizer steps between updates of the average; at least 1.
        begin_iter: before iteration `begin_iter` (counted from 1) the average copies the weights instead
            of averaging them; 0: average from the start.
        begin_epoch: the same in epochs (counted from 1); set at most one of `begin_iter` and `begin_epoch`.
        update_buffers: also average the floating-point buffers (BatchNorm statistics); False: validation
            and test use the model's own buffers.
        gamma: ``MomentumAnnealingEMA`` only: how slowly the weight anneals toward `momentum` (see
            `ema_type`; `steps` counts optimizer steps); above 0.

    Raises:
        ValueError: `momentum` is not in (0, 1), `ema_type` is not one of ``EMA_TYPES``, `interval` is
            below 1, `begin_iter` or `begin_epoch` is negative or both are set, or `gamma` is not above 0.
    """

    supports_sharding = False  # its copies of the parameters are not sharded; not checked with FSDP2 yet
    priority = Priority.NORMAL

    def __init__(
        self,
        momentum: float = 0.0002,
        ema_type: str = "ExponentialMovingAverage",
        interval: int = 1,
        begin_iter: int = 0,
        begin_epoch: int = 0,
        update_buffers: bool = False,
        gamma: float = 100.0,
    ) -> None:
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum must be in (0, 1), got {momentum}")
        if ema_type not in EMA_TYPES:
            raise ValueError(f"ema_type must be one of {', '.join(EMA_TYPES)}, got {ema_type!r}")
        if interval < 1 or begin_iter < 0 or begin_epoch < 0:
            raise ValueError("interval must be >= 1, begin_iter and begin_epoch >= 0")
        if begin_iter and begin_epoch:
            raise ValueError("set begin_iter or begin_epoch, not both")
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.momentum = momentum
        self.ema_type = ema_type
        self.interval = interval
        self.begin_iter = begin_iter
        self.begin_epoch = begin_epoch
        self.update_buffers = update_buffers
        self.gamma = gamma
        self.steps = 0
        self._names: list[str] = []
        self._live: list[torch.Tensor] = []  # the model's parameters (and buffers)
        self._ema: list[torch.Tensor] | None = None
        self._pending: Mapping[str, torch.Tensor] | None = None  # from a resumed checkpoint

    # -- set-up -------------------------------------------------------------------------------
    def before_run(self, runner: Runner) -> None:
        tensors = list(runner.model.named_parameters())
        if self.update_buffers:
            tensors += [(n, b) for n, b in runner.model.named_buffers() if b.is_floating_point()]
        self._names = [parameter_name(n) for n, _ in tensors]  # the state_dict keys, with activation checkpointing too
        self._live = [t for _, t in tensors]

    def _ensure_ema(self) -> list[torch.Tensor]:
        """The average, created on first use (after any checkpoint's weights were applied)."""
        if self._ema is None:
            if self._pending is not None:
                self._ema = [self._pending[n].to(t.device, t.dtype).clone() for n, t in zip(self._names, self._live)]
                self._pending = None
            else:
                self._ema = [t.detach().clone() for t in self._live]
        return self._ema

    # -- averaging ----------------------------------------------------------------------------
    def after_optimizer_step(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        ema = self._ensure_ema()
        live = [t.detach() for t in self._live]
        started = runner.epoch + 1 >= self.begin_epoch if self.begin_epoch else runner.iter + 1 >= self.begin_iter
        if not started or self.steps == 0:
            torch._foreach_copy_(ema, live)
        elif self.steps % self.interval == 0:
            torch._foreach_lerp_(ema, live, self._weight())
        self.steps += 1

    def _weight(self) -> float:
        if self.ema_type == "StochasticWeightAverage":
            return 1.0 / (self.steps // self.interval + 1)
        if self.ema_type == "MomentumAnnealingEMA":
            return max(self.momentum, self.gamma / (self.gamma + self.steps))
        return self.momentum

    # -- evaluate with the average --------------------------------------------------------------
    def _swap(self) -> None:
        ema = self._ensure_ema()
        for i, t in enumerate(self._live):
            t.data, ema[i] = ema[i], t.data  # exchanges storage; no copy

    def before_val_epoch(self, runner: Runner) -> None:
        self._swap()

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._swap()

    def before_test_epoch(self, runner: Runner) -> None:
        self._swap()

    def after_test_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._swap()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    def before_save_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None:
        # The average where the weights are, copied at most once: on the host for a synchronous save
        # (a CPU tensor as it is: the file is written before the next step changes it), and on the
        # GPU when async_save's writer stages every tensor to host memory itself (on a staging stream:
        # a .cpu() here would be a synchronous copy the loop waits for). A sharded save's weights are
        # in its shards: the average goes to the host as before.
        ema = self._ensure_ema()
        weights = checkpoint.get("state_dict", {}).values()
        # (the weights scanned only for an average off the host: a CPU run's saves skip it)
        on_device = (
            bool(ema) and not ema[0].is_cpu and any(isinstance(v, torch.Tensor) and not v.is_cpu for v in weights)
        )
        checkpoint["ema_state_dict"] = {
            n: t.detach() if t.is_cpu or on_device else t.detach().cpu() for n, t in zip(self._names, ema)
        }

    def after_load_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None:
        if runner.load_purpose in ("resume", "test") and "ema_state_dict" in checkpoint:
            self._pending = checkpoint["ema_state_dict"]
            self._ema = None
