"""expkit's training iteration against the raw loop's, in one process, on the same model.

`peers.py` compares whole runs, each in its own process: its gap mixes the iterations with
what runs once an epoch or once a run, and each process's own luck (address layout, the
machine's moment). Here one Runner is built on the peer workload (`peers.py`: MLP on digits,
batch 32, SGD with momentum, one thread) and, from a ``before_train`` hook, the same model,
optimizer and loader train whole epochs in alternation:

- ``raw loop``: the raw loop's body as `peers.py` writes it (forward, loss, backward, step,
  ``zero_grad``, the loss kept, its mean read every 10 iterations);
- ``expkit``: ``TrainLoop.run_iter`` over the same batches, the default hooks at their logging
  steps (every 10 iterations and the epoch's last) as in a run;
- ``expkit, no logging steps``: the same with no logging step (``log_every`` 0): the iteration
  alone.

Rounds alternate the order. The table gives each side's epoch (min and median, ms) and its
excess over the raw loop an iteration (min against min, and the median of the rounds' paired
differences). Then a logging step alone, warm: expkit's hooks at one (``after_train_iter``
with 10 losses in the window) against the raw loop's (the mean of 10 losses, a JSON line
written), 2,000 alternations. What the warm figure lacks of the one in a run is what running
cold costs.

    python benchmarks/loop_ab.py [--rounds 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _handwritten import MLP, READ_DIGITS
from torch import nn  # noqa: F401  (the MLP's expression names it)
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

logging.basicConfig(level=logging.WARNING)  # as peers.py's expkit side: no log lines formatted

from expkit import Hook, Runner, TrainerSettings
from expkit.core.stages import Stage
from expkit.engine.loops import TrainLoop


def _workload() -> tuple[DataLoader, DataLoader]:
    scope: dict = {}
    exec(READ_DIGITS, scope)  # noqa: S102 - x, y: the digits as peers.py reads them (the benchmarks' own code)
    x, y = scope["x"], scope["y"]
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_train, n_val = int(0.7 * len(y)), int(0.15 * len(y))
    train_set = TensorDataset(x[order[:n_train]], y[order[:n_train]])
    val_set = TensorDataset(x[order[n_train : n_train + n_val]], y[order[n_train : n_train + n_val]])
    train = DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    return train, DataLoader(val_set, batch_size=32)


class _Alternate(Hook):
    """Times the sides from before_train, then stops the run before its first epoch."""

    priority = "LOWEST"  # after the default hooks' before_train (the logger's window is set there)

    def __init__(self, train: DataLoader, rounds: int, steps: int, work: Path) -> None:
        self.train, self.rounds, self.steps, self.work = train, rounds, steps, work
        self.epochs: dict[str, list[float]] = {}
        self.steps_us: dict[str, list[float]] = {}

    def before_train(self, runner: Runner) -> None:
        model, train = runner.model, self.train
        loop = TrainLoop(runner)
        optimizer = loop.plain_optimizer
        assert optimizer is not None, "the plain iteration (one optimizer, fp32, no clipping)"
        every = runner.hook_table.log_interval()
        loop.epoch_len, loop.last_iter = runner.steps_per_epoch, None

        def raw_epoch() -> None:
            losses = []
            for xb, yb in train:
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                if len(losses) == 10:
                    torch.stack(losses).mean().item()
                    losses = []

        def expkit_epoch(log_every: int) -> None:
            loop.log_every = log_every
            runner.call_hook(Stage.BEFORE_TRAIN_EPOCH)  # (the logger counts the epoch's length here)
            runner.train_window.restart(time.perf_counter())
            for index, window in enumerate(zip(train)):
                loop.run_iter(index, window)

        sides = {
            "raw loop": raw_epoch,
            "expkit": lambda: expkit_epoch(every),
            "expkit, no logging steps": lambda: expkit_epoch(0),
        }
        self.epochs = {name: [] for name in sides}
        raw_epoch()  # (not counted: the first epoch allocates the optimizer's state)
        names = list(sides)
        for r in range(self.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order if r % 2 else order[::-1]:
                start = time.perf_counter()
                sides[name]()
                self.epochs[name].append(time.perf_counter() - start)
        self._logging_steps(runner)
        runner.request_stop("loop_ab.py has timed its sides", resumable=False)

    def _logging_steps(self, runner: Runner) -> None:
        window, call = runner.train_window, runner.call_hook
        losses = [torch.tensor(0.5 + i / 100) for i in range(10)]
        record = (self.work / "raw.jsonl").open("w")

        def expkit_step(i: int) -> None:
            window.losses.extend(losses)
            window.iters += 10
            window.step_s = time.perf_counter()
            with runner.hook_table.log_step:
                call(Stage.AFTER_TRAIN_ITER, batch_idx=9, data_batch=None, outputs={})
            window.losses.clear()
            window.restart(time.perf_counter(), window.step_s)

        def raw_step(i: int) -> None:
            record.write(json.dumps({"step": i, "train/loss": torch.stack(losses).mean().item()}) + "\n")

        self.steps_us = {"raw loop": [], "expkit": []}
        for i in range(self.steps):
            for name, step in (("raw loop", raw_step), ("expkit", expkit_step)):
                start = time.perf_counter()
                step(i)
                self.steps_us[name].append((time.perf_counter() - start) * 1e6)
        record.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 50 logging steps: checks the script runs (CI)")
    args = parser.parse_args()
    rounds, steps = (3, 50) if args.quick else (args.rounds, 2000)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, val = _workload()
    model = eval(MLP)  # (the benchmarks' own expression of the default model)
    with tempfile.TemporaryDirectory() as work:
        timer = _Alternate(train, rounds, steps, Path(work))
        runner = Runner(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            train_loader=train,
            val_loader=val,
            work_dir=work,
            hooks=[timer],
            settings=TrainerSettings(max_epochs=1, device="cpu", seed=None),
        )
        runner.run()
    iterations = len(train)
    raw = timer.epochs["raw loop"]
    print(
        f"one process, one model: MLP 64-256-256-10, digits, batch 32, SGD, {iterations} iterations an epoch, "
        f"1 thread; {rounds} alternated rounds"
    )
    print("| side | epoch min ms | epoch median ms | excess an iteration, min us | paired median us |")
    print("|---|---:|---:|---:|---:|")
    for name, values in timer.epochs.items():
        excess_min = (min(values) - min(raw)) / iterations * 1e6
        paired = statistics.median(v - b for v, b in zip(values, raw)) / iterations * 1e6
        print(
            f"| {name} | {min(values) * 1e3:.2f} | {statistics.median(values) * 1e3:.2f} | "
            f"{excess_min:+.1f} | {paired:+.1f} |"
        )
    warm = {name: statistics.median(values) for name, values in timer.steps_us.items()}
    print(
        f"\na logging step, warm ({steps} alternations, medians): expkit {warm['expkit']:.1f} us, "
        f"raw loop {warm['raw loop']:.1f} us"
    )


if __name__ == "__main__":
    sys.exit(main())
