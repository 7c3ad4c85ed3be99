"""MomentumEncoderHook: a target network that follows an online one (VISSL's MoCoHook; BYOL, MoCo).

After every optimizer step, ``target = m * target + (1 - m) * online`` for the parameters
(buffers are copied). ``m`` is constant, or rises from ``momentum`` to ``end_momentum`` along a
half cosine over the run (BYOL's schedule). The target's weights live in the model's
``state_dict``, so they are checkpointed with it; the hook's own state is the momentum last used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.errors import ConfigError
from expkit.core.stages import Priority
from expkit.hooks.base import Hook
from expkit.models import submodule

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["SCHEDULES", "MomentumEncoderHook"]


SCHEDULES = ("constant", "cosine")


class MomentumEncoderHook(Hook):
    """``online`` / ``target``: the model's submodules (dotted paths) with the same structure.
    ``momentum``: the starting m; ``schedule``: constant or cosine (to ``end_momentum`` at the
    last iteration). At the start of a run that does not resume, the target is set to the online
    weights; the target never gets gradients.

    Args:
        online: the dotted path of the model's submodule that the optimizer trains.
        target: the dotted path of the submodule that follows it (the same structure, checked when
            training starts); its parameters are frozen.
        momentum: m at the start, in [0, `end_momentum`]; m = 1 keeps the target as it is.
        schedule: ``constant`` (m stays `momentum`) or ``cosine`` (m rises to `end_momentum` along a
            half cosine over the run's iterations).
        end_momentum: m at the end of the run, at most 1 (``cosine`` only).

    Raises:
        ValueError: not 0 <= `momentum` <= `end_momentum` <= 1, or `schedule` is not one of ``SCHEDULES``.
    """

    supports_sharding = False  # its copies of the parameters are not sharded; not checked with FSDP2 yet
    priority = Priority.NORMAL

    def __init__(
        self,
        online: str = "online",
        target: str = "target",
        momentum: float = 0.99,
        schedule: str = "cosine",
        end_momentum: float = 1.0,
    ) -> None:
        if not 0.0 <= momentum <= end_momentum <= 1.0:
            raise ValueError(f"need 0 <= momentum <= end_momentum <= 1, got {momentum} and {end_momentum}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.online_name, self.target_name = online, target
        self.momentum, self.schedule, self.end_momentum = momentum, schedule, end_momentum
        self.current = momentum

    def before_train(self, runner: Runner) -> None:
        self.online = submodule(runner.model, self.online_name, "hooks.momentum_encoder.online")
        self.target = submodule(runner.model, self.target_name, "hooks.momentum_encoder.target")
        online_shapes = [p.shape for p in self.online.parameters()]
        if online_shapes != [p.shape for p in self.target.parameters()]:
            raise ConfigError(f"hooks.momentum_encoder: {self.target_name} and {self.online_name} differ in structure")
        for p in self.target.parameters():
            p.requires_grad_(False)
        if not runner.resuming:
            self.target.load_state_dict(self.online.state_dict())

    def momentum_at(self, step: int, total: int) -> float:
        """m after `step` of `total` optimizer steps."""
        if self.schedule == "constant" or total <= 0:
            return self.momentum
        return self.end_momentum - (self.end_momentum - self.momentum) * (math.cos(math.pi * step / total) + 1) / 2

    @torch.no_grad()
    def after_optimizer_step(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        self.current = m = self.momentum_at(runner.iter, runner.max_iters)
        for t, o in zip(self.target.parameters(), self.online.parameters()):
            t.mul_(m).add_(o, alpha=1 - m)
        for t, o in zip(self.target.buffers(), self.online.buffers()):
            t.copy_(o)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.current}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.current = float(state.get("momentum", self.momentum))
