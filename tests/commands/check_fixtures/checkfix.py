"""Experiments broken on purpose, one way each, for ``python -m expkit.check`` to catch
(tests/commands/test_check.py). Each is the kind of code a researcher writes; none is exotic."""

from __future__ import annotations

import random
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

from expkit import Hook
from expkit.data import DigitsData
from expkit.metrics import Accuracy
from expkit.models import MLP
from expkit.samplers import SeededRandomSampler


# -- a hook that keeps state but has no state_dict() -------------------------------------------------
class HiddenEMA(Hook):
    """An exponential moving average of the weights, kept in self.shadow, never saved."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        for name, p in runner.model.named_parameters():
            old = self.shadow.get(name)
            self.shadow[name] = p.detach().clone() if old is None else self.decay * old + (1 - self.decay) * p.detach()


# -- a hook that changes a weight after a resume (the check must not pass then) ----------------------
class PerturbAfterResume(Hook):
    def before_train(self, runner):
        if runner.resuming:
            with torch.no_grad():
                next(runner.model.parameters()).view(-1)[0] += 1e-3


# -- data ----------------------------------------------------------------------------------------------
class _Augmented(Dataset):
    """Digits plus a little noise, drawn by `draw(shape)` at every item."""

    def __init__(self, base: Dataset, draw) -> None:
        self.base, self.draw = base, draw

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.05 * self.draw(x.shape), y


def _loader(ds, sampler=None, **kwargs) -> DataLoader:
    return DataLoader(ds, batch_size=32, sampler=sampler, **kwargs)


class ClockSeededAugmentation(DigitsData):
    """Noise from a generator seeded by the clock: no two runs see the same batches."""

    def loaders(self):
        train, val, test = self.datasets()
        g = torch.Generator().manual_seed(time.time_ns())
        aug = _Augmented(train, lambda shape: torch.randn(shape, generator=g))
        return _loader(aug, SeededRandomSampler(train, self.seed)), _loader(val), _loader(test)


class WorkerRandomAugmentation(DigitsData):
    """Noise from the global `random` module inside DataLoader workers, whose seeds come from the
    global torch generator at each epoch's start (no generator= on the loader)."""

    def loaders(self):
        train, val, test = self.datasets()
        aug = _Augmented(train, lambda shape: torch.full(shape, random.random()))
        sampler = SeededRandomSampler(train, self.seed)
        return _loader(aug, sampler, num_workers=2), _loader(val), _loader(test)


class PlainShuffle(DigitsData):
    """DataLoader(shuffle=True): torch's RandomSampler, drawn anew from the global generator."""

    def loaders(self):
        train, val, test = self.datasets()
        return _loader(train, RandomSampler(train)), _loader(val), _loader(test)


# -- a metric that is never reset ------------------------------------------------------------------------
class AccumulatingAccuracy(Accuracy):
    """reset() that forgets to clear: every validation adds to the last one's counts."""

    def reset(self) -> None:
        if not hasattr(self, "total"):
            super().reset()


# -- a model with an op torch has no deterministic implementation of ------------------------------------
class UnpoolMLP(MLP):
    def forward(self, x):
        out = super().forward(x)  # (batch, classes)
        pooled, idx = nn.functional.max_pool1d(out.unsqueeze(1), 2, return_indices=True)
        return out + 0 * nn.functional.max_unpool1d(pooled, idx, 2, output_size=out.unsqueeze(1).shape).squeeze(1)
