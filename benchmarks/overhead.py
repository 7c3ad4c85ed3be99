"""Framework overhead: expkit's Runner (all default hooks) against a hand-written loop.

Same workload, one process, interleaved rounds (the machine is shared and noisy, so the
ratio of the two, measured side by side, is the figure that counts):
MLP 64-256-256-10 on digits, batch 32, SGD, one torch thread, 20 epochs, validation
every epoch. The hand-written loop does the work the default hooks do: it logs the loss
every 10 iterations to metrics.jsonl, validates (loss + accuracy) every epoch, saves a
checkpoint (model + optimizer) every epoch and the best one by val accuracy.

    python benchmarks/overhead.py [--epochs 20] [--rounds 5] [--ema]

Target: ratio <= 1.05. Prints wall and CPU times of each side, the ratios (median of
paired rounds, and of the minimums) and the overhead per iteration.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from expkit import Runner, TrainerSettings, default_hooks, seed_everything
from expkit.data import DigitsData
from expkit.hooks import CheckpointHook, EMAHook
from expkit.models import MLP


def make(seed: int = 0):
    seed_everything(seed)
    data = DigitsData(batch_size=32, seed=seed)
    train, val, _ = data.loaders()
    model = MLP(1, 8, 10, hidden=(256, 256))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return model, optimizer, train, val


def hand_written(work_dir: Path, epochs: int, ema: bool, checkpoints: bool = True) -> tuple[float, float]:
    model, optimizer, train, val = make()
    criterion = nn.CrossEntropyLoss()
    ema_params = [p.detach().clone() for p in model.parameters()] if ema else None
    (work_dir / "checkpoints").mkdir(parents=True)
    log = open(work_dir / "metrics.jsonl", "a")
    best_acc, step = -1.0, 0
    start, cpu = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        train.sampler.set_epoch(epoch)
        model.train()
        losses = []
        for i, (x, y) in enumerate(train):
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema_params is not None:
                torch._foreach_lerp_(ema_params, [p.detach() for p in model.parameters()], 0.01)
            step += 1
            losses.append(loss.detach())
            if (i + 1) % 10 == 0 or i + 1 == len(train):
                mean = torch.stack([v.detach() for v in losses]).mean().item()
                losses.clear()
                lr = optimizer.param_groups[0]["lr"]
                log.write(json.dumps({"step": step, "epoch": epoch + 1, "train/loss": mean, "train/lr": lr}) + "\n")
                log.flush()
        params = list(model.parameters())
        if ema_params is not None:  # validate with the average, as EMAHook does
            for p, e in zip(params, ema_params):
                p.data, e.data = e.data, p.data
        model.eval()
        correct, total, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for x, y in val:
                logits = model(x)
                loss_sum += criterion(logits, y) * len(y)
                correct += (logits.argmax(-1) == y).sum()
                total += len(y)
        if ema_params is not None:
            for p, e in zip(params, ema_params):
                p.data, e.data = e.data, p.data
        acc = float(correct) / total
        log.write(json.dumps({"step": step, "val/acc": acc, "val/loss": float(loss_sum) / total}) + "\n")
        if checkpoints:  # after validation, so that the best score is in it
            state = {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            if ema_params is not None:
                state["ema_state_dict"] = dict(zip([n for n, _ in model.named_parameters()], ema_params))
            torch.save(state, work_dir / "checkpoints" / f"epoch_{epoch + 1}.pth")
            if acc > best_acc:
                best_acc = acc
                torch.save({"state_dict": model.state_dict()}, work_dir / "checkpoints" / "best.pth")
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    log.close()
    return elapsed


def with_runner(work_dir: Path, epochs: int, ema: bool, checkpoints: bool = True) -> tuple[float, float]:
    model, optimizer, train, val = make()
    runner = Runner(
        model=model,
        optimizer=optimizer,
        train_loader=train,
        val_loader=val,
        settings=TrainerSettings(max_epochs=epochs, device="cpu", seed=0),
        work_dir=work_dir,
        hooks={"ema": EMAHook(momentum=0.01)} if ema else {},
        default_hooks=default_hooks(checkpoint=CheckpointHook(interval=1, save_best="val/acc") if checkpoints else None),
    )
    start, cpu = time.perf_counter(), time.process_time()
    runner.run()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved repetitions of each side")
    parser.add_argument("--ema", action="store_true", help="add EMAHook (and the same EMA update by hand)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # no terminal lines on either side

    iters = args.epochs * len(make()[2])
    sides = {
        "hand-written": lambda d: hand_written(d, args.epochs, args.ema),
        "expkit": lambda d: with_runner(d, args.epochs, args.ema),
        "hand, no ckpt": lambda d: hand_written(d, args.epochs, args.ema, checkpoints=False),
        "expkit, no ckpt": lambda d: with_runner(d, args.epochs, args.ema, checkpoints=False),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        hand_written(Path(tmp) / "warmup_a", 1, args.ema)  # imports, allocator, caches
        with_runner(Path(tmp) / "warmup_b", 1, args.ema)
        for r in range(args.rounds):  # alternate the order each round: no order bias
            order = list(sides.items())
            for i, (name, fn) in enumerate(order if r % 2 == 0 else order[::-1]):
                times[name].append(fn(Path(tmp) / f"{r}_{i}"))

    print(f"workload: MLP 64-256-256-10, digits, batch 32, SGD, 1 thread, {args.epochs} epochs "
          f"({iters} iterations), validation every epoch{', EMA' if args.ema else ''}; "
          "with ckpt: a checkpoint every epoch + the best one")  # fmt: skip
    for name, values in times.items():
        wall, cpu = [v[0] for v in values], [v[1] for v in values]
        print(f"  {name:<16} wall median {statistics.median(wall):.3f} s (min {min(wall):.3f})   "
              f"cpu median {statistics.median(cpu):.3f} s (min {min(cpu):.3f})")  # fmt: skip
    for ours, hand, label in (("expkit", "hand-written", "all default hooks"),
                              ("expkit, no ckpt", "hand, no ckpt", "without checkpoints")):  # fmt: skip
        for kind, k in (("wall", 0), ("cpu ", 1)):
            o, h = [v[k] for v in times[ours]], [v[k] for v in times[hand]]
            paired = statistics.median(a / b for a, b in zip(o, h))
            print(f"ratio {kind} ({label}): median of paired rounds {paired:.3f}, min/min {min(o) / min(h):.3f}; "
                  f"overhead per iteration {(statistics.median(o) - statistics.median(h)) / iters * 1e6:.1f} us")
    print("target: ratio <= 1.05. The machine is shared: CPU time (user + system of this process) is the")
    print("steadier figure; wall time adds waiting for the disk and for other tenants.")

if __name__ == "__main__":
    main()
