"""Training from tar shards: expkit's ``data=webdataset`` against a hand-written webdataset +
DataLoader loop over the same shards, side by side; and peak memory over shards larger than
memory would like.

Speed. The shards: ``--samples`` samples (default 8,192) of a 3x32x32 float32 array (``.npy``,
12 KiB) and a class, 512 to a shard, written by ``webdataset.ShardWriter``. The workload: an
MLP 3072-256-10, SGD, batch 64, ``--epochs`` epochs, 2 DataLoader workers, one torch thread,
no validation, on the CPU. The hand-written side is the webdataset idiom
(``WebDataset(urls, shardshuffle=True).shuffle(1000).decode().to_tuple("npy", "cls")`` in a
DataLoader); expkit's side is a ``Runner`` over ``WebDatasetData`` (index cached beforehand, as
every run after the first finds it), with its default hooks (a checkpoint per epoch,
metrics.jsonl). Each variant runs in its own fresh process; the time is the training itself
(the hand loop's loops, ``Runner.run()``). Rounds are interleaved (``_table.round_order``); every round, the
minimum and the median are printed, with the ratio (target: at most 1.05x).

Memory. ``--memory-gb`` GiB of shards (default 2; 0: skipped) of 256 KiB samples, one epoch of
``data=webdataset`` with the loading in the training process (``num_workers=0``: its peak RSS
is the whole of it), against one epoch of the default digits run; target: at most the digits
run's peak + 300 MB.

    python benchmarks/data_stream.py [--rounds 5] [--epochs 2] [--samples 8192] [--memory-gb 2] [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _table import ratio_table, round_order

COMMON = """
import json, sys, time, resource
import torch
from torch import nn
from torch.nn import functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
URLS, EPOCHS, WORK = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def make_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10))
def report(seconds, samples):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"seconds": seconds, "samples": samples, "peak_mb": peak}), flush=True)
"""

HAND = (
    COMMON
    + """
import webdataset as wds
from torch.utils.data import DataLoader
dataset = wds.WebDataset(URLS, shardshuffle=True, nodesplitter=wds.split_by_node).shuffle(1000).decode().to_tuple("npy", "cls")
loader = DataLoader(dataset, batch_size=64, num_workers=2, persistent_workers=True, prefetch_factor=2)
model = make_net()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
log = open(f"{WORK}/metrics.jsonl", "w")
start, step, samples, losses = time.perf_counter(), 0, 0, []
for epoch in range(EPOCHS):
    model.train()
    for xb, yb in loader:
        loss = F.cross_entropy(model(torch.as_tensor(xb)), torch.as_tensor(yb))
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.detach()); step += 1; samples += len(yb)
        if step % 10 == 0:
            log.write(json.dumps({"step": step, "train/loss": torch.stack(losses).mean().item()}) + "\\n"); losses = []
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{WORK}/epoch_{epoch + 1}.pth")
report(time.perf_counter() - start, samples)
"""
)

EXPKIT = (
    COMMON
    + """
import logging
logging.basicConfig(level=logging.WARNING)
from expkit import Runner, TrainerSettings
from expkit.data.shards import WebDatasetData
data = WebDatasetData(train=URLS, num_classes=10, batch_size=64, num_workers=int(sys.argv[4]), index_dir=sys.argv[5])
train, _, _ = data.loaders()
model = make_net()
runner = Runner(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                train_loader=train, work_dir=WORK, settings=TrainerSettings(max_epochs=EPOCHS, device="cpu", seed=None))
start = time.perf_counter()
runner.run()
report(time.perf_counter() - start, EPOCHS * len(train.sampler))
"""
)

DIGITS = """
import json, resource, sys
import torch
torch.set_num_threads(1)
import logging
logging.basicConfig(level=logging.WARNING)
from expkit import Runner, TrainerSettings
from expkit.data import DigitsData
from expkit.models import MLP
train, val, _ = DigitsData(num_workers=0).loaders()
model = MLP(in_channels=1, image_size=8, num_classes=10)
runner = Runner(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_loader=train,
                val_loader=val, work_dir=sys.argv[3], settings=TrainerSettings(max_epochs=1, device="cpu", seed=None))
runner.run()
print("RESULT " + json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
"""


def write_shards(out: Path, samples: int, shape: tuple[int, ...], per_shard: int) -> str:
    """``samples`` samples of a random float32 array of `shape` and a class; returns the brace pattern."""
    import numpy as np
    import webdataset

    out.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)
    with webdataset.ShardWriter(str(out / "s-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(samples):
            buffer = io.BytesIO()
            np.save(buffer, g.random(shape, dtype=np.float32))
            sink.write({"__key__": f"{i:08d}", "npy": buffer.getvalue(), "cls": str(i % 10).encode()})
    last = (samples - 1) // per_shard
    return str(out / f"s-{{000000..{last:06d}}}.tar")


def run_once(code: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"a run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def speed(tmp: Path, rounds: int, epochs: int, samples: int) -> None:
    urls = write_shards(tmp / "speed", samples, (3, 32, 32), 512)
    index = str(tmp / "index")
    variants = {"hand-written": (HAND,), "expkit": (EXPKIT, "2", index)}
    for code, *extra in variants.values():  # not counted: byte-code caches, and expkit's index (built once)
        work = tempfile.mkdtemp(dir=tmp)
        run_once(code, urls, "1", work, *extra)
        shutil.rmtree(work, ignore_errors=True)  # (as each timed run's, below)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in round_order(names, r):
            code, *extra = variants[name]
            work = tempfile.mkdtemp(dir=tmp)
            times[name].append(run_once(code, urls, str(epochs), work, *extra)["seconds"])
            shutil.rmtree(work, ignore_errors=True)  # (its checkpoints are not written back inside the next run)
    print(
        f"speed: {samples} samples of 3x32x32 float32 (.npy) in {-(-samples // 512)} shards, MLP 3072-256-10, batch 64, "
        f"{epochs} epochs, 2 workers, 1 thread, CPU; {rounds} interleaved rounds, each its own process"
    )
    print(ratio_table(times, "hand-written"))


def memory(tmp: Path, gigabytes: float) -> None:
    per_sample = 256 * 1024  # 256 KiB: 4 x 128 x 128 float32
    samples = int(gigabytes * 2**30 / per_sample)
    urls = write_shards(tmp / "memory", samples, (4, 128, 128), 256)
    size = sum(p.stat().st_size for p in (tmp / "memory").iterdir()) / 2**30
    digits = run_once(DIGITS, "", "1", tempfile.mkdtemp(dir=tmp))["peak_mb"]
    # a model of 50 parameters: the memory measured is the data's (an MLP on 65,536 inputs would add 200 MB of
    # weights, gradients and momentum)
    code = EXPKIT.replace(
        "nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10)",
        "nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)",
    )
    shards = run_once(code, urls, "1", tempfile.mkdtemp(dir=tmp), "0", str(tmp / "index-memory"))
    print(
        f"memory: {size:.2f} GiB of shards ({samples} samples of 256 KiB), one epoch in the training process "
        f"(num_workers=0): peak RSS {shards['peak_mb']:.0f} MB; a digits run: {digits:.0f} MB; "
        f"difference {shards['peak_mb'] - digits:+.0f} MB (target: at most +300 MB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--memory-gb", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="1 round, 1,024 samples, 64 MiB: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.epochs, args.samples, args.memory_gb = 1, 1, 1024, 1 / 16
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )
    with tempfile.TemporaryDirectory() as name:
        speed(Path(name), args.rounds, args.epochs, args.samples)
        if args.memory_gb > 0:
            memory(Path(name), args.memory_gb)


if __name__ == "__main__":
    main()
