"""A model that owns its update: GANs, actor-critic, meta-learning.

A model whose ``train_step`` takes a second argument gets an ``Optimizers`` and does its own
backward passes and steps, as with Lightning's manual optimization or MMEngine's
``train_step(data, optim_wrapper)``::

    class GAN(nn.Module):
        def train_step(self, batch, optimizers):
            optimizers.zero_grad("discriminator")
            optimizers.backward(d_loss)             # through the fp16 grad scaler when there is one
            optimizers.step("discriminator")        # gradient clipping, the step, zero_grad
            ...
            return {"loss": d_loss + g_loss, "log": {"d_loss": d_loss, "g_loss": g_loss}}

The loop around it stays the same: hooks, logging (``log`` entries become ``train/<key>``),
the grad scaler's update once per iteration, schedulers, checkpoints of every optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from expkit.core.errors import ConfigError

__all__ = ["Optimizers", "check_owned_update", "owns_its_update"]


def owns_its_update(model: torch.nn.Module) -> bool:
    """Whether the model's ``train_step`` takes the optimizers (a second parameter).

    Args:
        model: the model to inspect.

    Returns:
        True when the model has a ``train_step`` with at least two parameters; False otherwise,
            also when its signature cannot be read.
    """
    step = getattr(model, "train_step", None)
    if step is None:
        return False
    try:
        return len(inspect.signature(step).parameters) >= 2
    except (TypeError, ValueError):
        return False


class Optimizers:
    """The run's optimizers by name, with the run's scaler and clipping; given to a model's
    ``train_step(batch, optimizers)``.

    Args:
        optimizers: the run's optimizers by name (the keys of the ``optim`` config).
        scaler: the run's gradient scaler (fp16 mixed precision), or None.
        clip_grad_norm: the largest total gradient norm ``step`` lets through
            (``trainer.clip_grad_norm``); None does not clip.
    """

    def __init__(
        self, optimizers: Mapping[str, torch.optim.Optimizer], scaler: Any = None, clip_grad_norm: float | None = None
    ) -> None:
        self._optimizers = dict(optimizers)
        self.scaler = scaler
        self.clip_grad_norm = clip_grad_norm

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        try:
            return self._optimizers[name]
        except KeyError:
            raise ConfigError(
                f"the model asked for optimizer {name!r}; optim defines {sorted(self._optimizers)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._optimizers)

    def __len__(self) -> int:
        return len(self._optimizers)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss`, through the grad scaler when there is one.

        Args:
            loss: the scalar loss to backpropagate.
        """
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def zero_grad(self, *names: str) -> None:
        """Clear the gradients of these optimizers' parameters (all when none is named).

        Args:
            *names: the names of the optimizers; none clears every optimizer's gradients.

        Raises:
            ConfigError: when a name is not one of the run's optimizers.
        """
        for name in names or tuple(self._optimizers):
            self[name].zero_grad(set_to_none=True)

    def step(self, name: str) -> None:
        """Clip (``trainer.clip_grad_norm``), step and zero the gradients of one optimizer.

        Args:
            name: the name of the optimizer.

        Raises:
            ConfigError: when `name` is not one of the run's optimizers.
        """
        optimizer = self._optimizers.get(name)
        if optimizer is None:
            optimizer = self[name]  # (names the missing one)
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)


def check_owned_update(runner: Any) -> None:
    """Several optimizers need a model that owns its update (``train_step(batch, optimizers)``),
    and such a model neither accumulates nor runs under DDP or FSDP yet.

    Args:
        runner: the Runner being built (its optimizers, settings and strategy are read).

    Raises:
        ConfigError: when several optimizers are defined for a model that does not own its
            update, or a model that owns its update is combined with
            ``trainer.accumulate_grad_batches`` > 1 or runs distributed (DDP or FSDP).
    """
    r = runner
    from expkit.core import distributed

    owned, is_distributed = r.manual_optimization, distributed.is_distributed()
    if len(r.optimizers) > 1 and not owned:
        raise ConfigError(
            f"optim defines {len(r.optimizers)} optimizers ({', '.join(r.optimizers)}): the model "
            "must own its update, with a train_step(batch, optimizers) that uses them"
        )
    if owned and r.settings.accumulate_grad_batches > 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches > 1 with a model that owns its update (train_step(batch, "
            "optimizers)): accumulate inside train_step instead"
        )
    if owned and is_distributed and r.sharded:
        raise ConfigError(
            "a model that owns its update (train_step(batch, optimizers)) is not supported with "
            "trainer.strategy=fsdp yet; train it with trainer.strategy=ddp"
        )
    if owned and is_distributed and r.optimizer is not None:
        raise ConfigError(
            "a model that owns its update (train_step(batch, optimizers)) cannot run under DDP "
            "yet: DDP needs the backward outside the forward; train it in one process"
        )
