"""Framework overhead: expkit's Runner (all default hooks + EMAHook) against a hand-written
loop doing the same work, in one process, interleaved rounds.

Workloads (``--workload``):
  mlp       MLP 64-256-256-10 on digits, batch 32, SGD, one torch thread, 20 epochs:
            per-step overhead dominates here. Target: ratio <= 1.05.
  resnet18  torchvision ResNet-18 on FakeData 3x64x64, batch 64, SGD, CPU, one thread. Target <= 1.02.
  resnet50cpu  ResNet-50 on FakeData 3x32x32, batch 8, 40 iterations, one thread: the GPU's regime
            (a big model, short and few iterations, ~100 MB checkpoints) on a CPU. Target <= 1.02.
  resnet50  ResNet-50 on FakeData 224x224, batch 128, bf16, CUDA, pinned memory, 8 persistent
            workers, channels-last: the GPU path. Target <= 1.02 (needs a GPU; exits 0 without).

The hand-written loop does what the default hooks and EMAHook do: logs the mean loss every
10 iterations to metrics.jsonl, updates the EMA of the weights after every step,
validates with the EMA weights every epoch (loss + accuracy), then saves a checkpoint
(model, optimizer, EMA) and the best one by val accuracy.

    python benchmarks/overhead.py [--workload mlp|resnet18|resnet50cpu|resnet50] [--rounds N] [--no-ema] [--quick]
                                  [--lightning]

``--quick`` (what CI runs, so the script cannot rot) shrinks the workload to seconds; its
figures mean nothing. Prints each side's times and throughput, and the ratios: the median
of paired rounds, and min/min (noise on a shared machine only adds time, so the minimum of
each side is its least disturbed run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from expkit import Runner, TrainerSettings, default_hooks, seed_everything
from expkit.hooks import CheckpointHook, EMAHook


@dataclasses.dataclass
class Workload:
    label: str
    make_model: Callable[[], nn.Module]
    make_data: Callable[[int], Any]  # seed -> DataModule
    epochs: int
    threads: int | None = None  # None: torch's default
    device: str = "cpu"
    precision: str = "32"
    channels_last: bool = False


def _workloads(quick: bool) -> dict[str, Workload]:
    from expkit.data import DigitsData, FakeImageData
    from expkit.models import MLP, torchvision_resnet

    def fake(size: int, batch: int, train_batches: int, val_batches: int, workers: int = 0) -> Callable[[int], Any]:
        return lambda seed: FakeImageData(
            train_size=batch * train_batches,
            val_size=batch * val_batches,
            image_size=size,
            batch_size=batch,
            num_workers=workers,
            seed=seed,
        )

    return {
        "mlp": Workload(
            "MLP 64-256-256-10, digits, batch 32, SGD, 1 thread",
            lambda: MLP(1, 8, 10, hidden=(256, 256)),
            lambda seed: DigitsData(batch_size=32, seed=seed),
            epochs=1 if quick else 20,
            threads=1,
        ),
        "resnet18": Workload(
            "torchvision ResNet-18, FakeData 3x64x64, batch 64, SGD, CPU, 1 thread",
            lambda: torchvision_resnet(3, 64, 10, "resnet18"),
            fake(32, 8, 2, 1) if quick else fake(64, 64, 5, 1),
            epochs=1 if quick else 2,
            threads=1,  # steadier on a shared machine than racing other tenants for every core
        ),
        # the GPU's regime on this CPU (issue 66): a big model, short iterations, few of them, the same
        # checkpoints (about 100 MB each) and validation: what a run pays besides the loop shows here
        "resnet50cpu": Workload(
            "torchvision ResNet-50, FakeData 3x32x32, batch 8, SGD, CPU, 1 thread, 40 iterations",
            lambda: torchvision_resnet(3, 32, 10, "resnet50"),
            fake(32, 8, 2, 1) if quick else fake(32, 8, 20, 2),
            epochs=1 if quick else 2,
            threads=1,
        ),
        "resnet50": Workload(
            "torchvision ResNet-50, FakeData 3x224x224, batch 128, SGD, bf16, CUDA, channels-last, 8 workers",
            lambda: torchvision_resnet(3, 224, 1000, "resnet50"),
            fake(224, 128, 4, 1, workers=8) if quick else fake(224, 128, 40, 4, workers=8),
            epochs=1 if quick else 2,
            device="cuda",
            precision="bf16",
            channels_last=True,
        ),
    }


def make(w: Workload, seed: int = 0):
    seed_everything(seed)
    train, val, _ = w.make_data(seed).loaders()
    model = w.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return model, optimizer, train, val


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_written(work_dir: Path, w: Workload, ema: bool, checkpoints: bool = True) -> tuple[float, float]:
    model, optimizer, train, val = make(w)
    device = torch.device(w.device)
    model.to(device)
    if w.channels_last:
        model.to(memory_format=torch.channels_last)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last if w.channels_last else torch.preserve_format
    dtype = {"32": None, "bf16": torch.bfloat16}[w.precision]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    criterion = nn.CrossEntropyLoss()
    params = list(model.parameters())
    ema_params = [p.detach().clone() for p in params] if ema else None
    (work_dir / "checkpoints").mkdir(parents=True)
    log = open(work_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed after the loop, as a hand-written script does
    best_acc, step = -1.0, 0
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    for epoch in range(w.epochs):
        train.sampler.set_epoch(epoch)
        model.train()
        losses = []
        for i, (x, y) in enumerate(train):
            x, y = x.to(device, non_blocking=True, memory_format=fmt), y.to(device, non_blocking=True)
            with autocast():
                loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema_params is not None:  # EMAHook's (MMEngine's) rule: the first step copies, the later ones average
                live = [p.detach() for p in params]
                if step == 0:
                    torch._foreach_copy_(ema_params, live)
                else:
                    torch._foreach_lerp_(ema_params, live, 0.01)
            step += 1
            losses.append(loss.detach())
            if (i + 1) % 10 == 0 or i + 1 == len(train):
                mean = torch.stack([v.float() for v in losses]).mean().item()
                losses.clear()
                lr = optimizer.param_groups[0]["lr"]
                log.write(json.dumps({"step": step, "epoch": epoch + 1, "train/loss": mean, "train/lr": lr}) + "\n")
                log.flush()
        if ema_params is not None:  # validate with the average, as EMAHook does
            for p, e in zip(params, ema_params):
                p.data, e.data = e.data, p.data
        model.eval()
        correct, total, loss_sum = 0, 0, torch.zeros((), device=device)
        with torch.no_grad():
            for x, y in val:
                x, y = x.to(device, non_blocking=True, memory_format=fmt), y.to(device, non_blocking=True)
                with autocast():
                    logits = model(x)
                    loss_sum += criterion(logits, y).float() * len(y)
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
                torch.save({k: v for k, v in state.items() if k != "optimizer"}, work_dir / "checkpoints" / "best.pth")
    _sync(device)
    elapsed = time.perf_counter() - start, time.process_time() - cpu
    log.close()
    return elapsed


def with_runner(
    work_dir: Path, w: Workload, ema: bool, checkpoints: bool = True, more_hooks: dict[str, Any] | None = None
) -> tuple[float, float]:
    model, optimizer, train, val = make(w)
    settings = TrainerSettings(
        max_epochs=w.epochs, device=w.device, seed=0, precision=w.precision, channels_last=w.channels_last
    )
    runner = Runner(
        model=model,
        optimizer=optimizer,
        train_loader=train,
        val_loader=val,
        settings=settings,
        work_dir=work_dir,
        hooks={**({"ema": EMAHook(momentum=0.01)} if ema else {}), **(more_hooks or {})},
        default_hooks=default_hooks(
            checkpoint=CheckpointHook(interval=1, save_best="val/acc") if checkpoints else None
        ),
    )
    _sync(runner.device)
    start, cpu = time.perf_counter(), time.process_time()
    runner.run()
    _sync(runner.device)
    return time.perf_counter() - start, time.process_time() - cpu


def with_lightning(work_dir: Path, w: Workload, ema: bool) -> tuple[float, float]:
    """The hand-written loop's Lightning twin: the same model, optimizer, loaders and work (the
    mean loss logged every 10 iterations, EMA after every step and validation on it, a checkpoint
    every epoch and the best by val/acc), with Lightning's defaults otherwise (its sanity check of
    two validation batches included: what a Lightning user pays), the progress bar and model
    summary off, a CSV logger. Needs ``lightning`` (the ``bench`` extra, or carried: gpu_check.sh)."""
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    warnings.filterwarnings("ignore", module="lightning")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    model, optimizer, train, val = make(w)
    if w.channels_last:
        model.to(memory_format=torch.channels_last)
    criterion = nn.CrossEntropyLoss()

    class Twin(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.ema: list[torch.Tensor] | None = None
            self.correct = self.seen = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = criterion(self.net(x), y)
            self.log("train/loss", loss, on_step=True, on_epoch=False)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if ema:
                params = [p.detach() for p in self.net.parameters()]
                if self.ema is None:
                    self.ema = [p.clone() for p in params]
                torch._foreach_lerp_(self.ema, params, 0.01)

        def _swap(self) -> None:
            if self.ema is not None:
                for p, e in zip(self.net.parameters(), self.ema):
                    p.data, e.data = e.data, p.data

        def on_validation_epoch_start(self) -> None:
            self._swap()
            self.correct = self.seen = 0

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.net(x)
            self.log("val/loss", criterion(logits, y), on_epoch=True)
            self.correct = self.correct + (logits.argmax(-1) == y).sum()
            self.seen += len(y)

        def on_validation_epoch_end(self) -> None:
            self.log("val/acc", float(self.correct) / max(self.seen, 1))
            self._swap()

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if self.ema is not None:
                names = [n for n, _ in self.net.named_parameters()]
                checkpoint["ema_state_dict"] = dict(zip(names, self.ema))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer

    ckpt = work_dir / "checkpoints"
    trainer = L.Trainer(
        max_epochs=w.epochs,
        accelerator="gpu" if w.device == "cuda" else "cpu",
        devices=1,
        precision={"32": "32-true", "bf16": "bf16-mixed"}[w.precision],
        benchmark=w.device == "cuda",
        default_root_dir=work_dir,
        logger=CSVLogger(work_dir),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=ckpt, filename="epoch_{epoch}", every_n_epochs=1, save_top_k=-1),
            ModelCheckpoint(dirpath=ckpt, filename="best", monitor="val/acc", mode="max", save_weights_only=True),
        ],
    )
    twin = Twin()
    _sync(torch.device(w.device))
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(twin, train, val)
    _sync(torch.device(w.device))
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("mlp", "resnet18", "resnet50cpu", "resnet50"), default="mlp")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved repetitions of each side")
    parser.add_argument(
        "--ema", action=argparse.BooleanOptionalAction, default=True, help="EMAHook and the same by hand"
    )
    parser.add_argument("--no-ckpt-variant", action="store_true", help="also time both sides without checkpoints")
    parser.add_argument("--quick", action="store_true", help="seconds, for CI: checks the script runs")
    parser.add_argument("--lightning", action="store_true", help="also the hand-written loop's Lightning twin")
    args = parser.parse_args()
    w = _workloads(args.quick)[args.workload]
    if w.device == "cuda" and not torch.cuda.is_available():
        print(f"{args.workload}: needs a CUDA GPU; none here, nothing measured")
        return
    rounds = args.rounds or (
        1 if args.quick else {"mlp": 10, "resnet18": 4, "resnet50cpu": 5, "resnet50": 3}[args.workload]
    )
    if w.threads:
        torch.set_num_threads(w.threads)
    logging.basicConfig(level=logging.WARNING)  # no terminal lines on either side

    train = w.make_data(0).loaders()[0]  # only to count iterations and samples: no model built
    iters, samples = w.epochs * len(train), w.epochs * len(train.dataset)
    sides = {
        "hand-written": lambda d: hand_written(d, w, args.ema),
        "expkit": lambda d: with_runner(d, w, args.ema),
    }
    if args.lightning:
        sides["Lightning"] = lambda d: with_lightning(d, w, args.ema)
    if args.no_ckpt_variant:
        sides["hand, no ckpt"] = lambda d: hand_written(d, w, args.ema, checkpoints=False)
        sides["expkit, no ckpt"] = lambda d: with_runner(d, w, args.ema, checkpoints=False)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        warm = dataclasses.replace(w, epochs=1)
        hand_written(Path(tmp) / "warmup_a", warm, args.ema)  # imports, allocator, caches, cuDNN autotuning
        with_runner(Path(tmp) / "warmup_b", warm, args.ema)
        if args.lightning:
            with_lightning(Path(tmp) / "warmup_c", warm, args.ema)
        for r in range(rounds):  # alternate the order each round: no order bias
            order = list(sides.items())
            for i, (name, fn) in enumerate(order if r % 2 == 0 else order[::-1]):
                times[name].append(fn(Path(tmp) / f"{r}_{i}"))

    threads = torch.get_num_threads() if w.device == "cpu" else "-"
    print(
        f"workload {args.workload}: {w.label}; {w.epochs} epochs ({iters} iterations, {samples} samples), "
        f"validation every epoch{', EMA' if args.ema else ''}, a checkpoint every epoch + the best one; "
        f"torch threads {threads}; {rounds} rounds{' (QUICK: figures mean nothing)' if args.quick else ''}"
    )
    for name, values in times.items():
        wall, cpu = [v[0] for v in values], [v[1] for v in values]
        print(
            f"  {name:<16} wall median {statistics.median(wall):.3f} s (min {min(wall):.3f}), "
            f"{samples / min(wall):.1f} samples/s   cpu median {statistics.median(cpu):.3f} s (min {min(cpu):.3f})"
        )
    pairs = [("expkit", "hand-written", "all default hooks")]
    if args.lightning:
        pairs.append(("Lightning", "hand-written", "Lightning's twin"))
    if args.no_ckpt_variant:
        pairs.append(("expkit, no ckpt", "hand, no ckpt", "without checkpoints"))
    for ours, hand, label in pairs:
        for kind, k in (("wall", 0), ("cpu ", 1)):
            o, h = [v[k] for v in times[ours]], [v[k] for v in times[hand]]
            paired = statistics.median(a / b for a, b in zip(o, h))
            print(
                f"ratio {kind} ({label}): min/min {min(o) / min(h):.3f}, median of paired rounds {paired:.3f}; "
                f"overhead per iteration {(min(o) - min(h)) / iters * 1e6:.0f} us"
            )
    target = {"mlp": 1.05, "resnet18": 1.02, "resnet50cpu": 1.02, "resnet50": 1.02}[args.workload]
    print(f"target: ratio <= {target}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
