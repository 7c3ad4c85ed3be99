"""Shared test helpers: a toy model and data small enough for unit tests in milliseconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from expkit import Hook, Runner, Stage, TrainerSettings
from expkit import default_hooks as make_default_hooks
from expkit.data import SeededRandomSampler
from expkit.hooks import LoggerHook
from expkit.metrics import Metric

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def toy_loaders(n_train: int = 8, n_val: int = 4, n_test: int = 4, batch_size: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(123)

    def ds(n: int) -> TensorDataset:
        x = torch.randn(n, 4, generator=g)
        return TensorDataset(x, (x[:, 0] > 0).long())

    train = ds(n_train)
    return (
        DataLoader(train, batch_size=batch_size, sampler=SeededRandomSampler(train, seed)),
        DataLoader(ds(n_val), batch_size=batch_size) if n_val else None,
        DataLoader(ds(n_test), batch_size=batch_size) if n_test else None,
    )


class Twin(nn.Module):
    """The toy network as ``online``, and a ``target`` of the same shape (momentum encoders)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.online(x)


def toy_runner(work_dir: Path, *, hooks: Any = (), default_hooks: Any = None, seed: int = 0, metrics: Any = None,
               monitor: str | None = None, model: nn.Module | None = None, **settings: Any) -> Runner:  # fmt: skip
    torch.manual_seed(seed)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    train, val, test = toy_loaders()  # the data order is config, the same on resume
    resume = settings.pop("resume", False)
    if default_hooks is None:  # the six defaults, without drawing curves.svg in every unit test
        default_hooks = make_default_hooks(logger=LoggerHook(plot=False))
    settings.setdefault("max_epochs", 2)
    return Runner(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        train_loader=train,
        val_loader=val,
        test_loader=test,
        settings=TrainerSettings(device="cpu", seed=seed, **settings),
        work_dir=work_dir,
        hooks=hooks,
        default_hooks=default_hooks,
        resume=resume,
        metrics=metrics,
        monitor=monitor,
    )


class Score(Metric):
    """A metric no name rule knows: the mean of the first logit (its direction must be set)."""

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += float(preds[:, 0].sum())
        self.count += len(preds)

    def compute(self) -> float:
        return self.total / max(self.count, 1)


class Recorder(Hook):
    """Overrides every stage and appends '<label>.<stage>' to a shared list."""

    def __init__(self, label: str, log: list[str], priority: Any = None) -> None:
        self.label = label
        self.log = log
        if priority is not None:
            self.priority = priority


def _recording(stage: str):
    def method(self: Recorder, runner: Runner, **payload: Any) -> None:
        self.log.append(f"{self.label}.{stage}")

    method.__name__ = stage
    return method


for _stage in Stage:
    setattr(Recorder, _stage.value, _recording(_stage.value))


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300):
    """python -m expkit.train ARGS in a subprocess; returns CompletedProcess (+ .output: both streams)."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "expkit.train", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]  # logs go to stdout, errors to stderr
    return proc


@pytest.fixture
def recorder_log() -> list[str]:
    return []
