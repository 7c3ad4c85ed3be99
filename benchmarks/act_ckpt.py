"""Activation checkpointing: peak memory and time per iteration, off against on
(``trainer.activation_checkpointing=full``), for a GPT-2 and a ResNet-50 side by side.

- GPT-2: 8 blocks x 256 wide, 8 heads, vocabulary 2,000 (transformers, from a config), a batch of
  48 sequences of 128 tokens: ``experiment=hf_causal_lm`` with ``model.config.n_layer=8
  model.config.n_embd=256 model.config.n_head=8 model.config.n_positions=128 data.block_size=128
  data.batch_size=48``. Checkpointed blocks: ``GPT2Block`` (its ``_no_split_modules``).
- ResNet-50 (torchvision, 10 classes), a batch of 16 images of 3x128x128. Checkpointed blocks:
  ``Bottleneck`` (expkit's ``fsdp_blocks`` for torchvision ResNets).

Each variant trains with AdamW in a fresh process on one thread (``--threads``), on random data,
through the same call the Runner makes (``expkit.core.activation_checkpointing.apply``). Per round
it records the process's peak RSS (ru_maxrss: what decides whether a run fits), the RSS when the
model is built, and per iteration after the first (which also creates the optimizer's state) the
wall seconds and the CPU seconds of the process. On a shared machine the wall time moves with the
other tenants' load, the CPU time of one thread much less: the time ratio is given in both.
Rounds interleave the variants; every round is printed, then the minimum and median of each
variant and the on/off ratios of the medians.

    python benchmarks/act_ckpt.py [--rounds 3] [--iters 4] [--threads 1] [--quick]

Targets (GPT-2): peak RSS at most 0.6x, time per iteration at most 1.4x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, time
import torch
from torch import nn
from expkit.core.activation_checkpointing import apply

workload, setting, iters, quick = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
setting = None if setting == "off" else setting
torch.manual_seed(0)
if workload == "gpt2":
    from expkit.tasks.hf import causal_lm

    layers, width, batch, length = (2, 64, 8, 32) if quick else (8, 256, 48, 128)
    config = {"model_type": "gpt2", "n_layer": layers, "n_embd": width, "n_head": 8, "n_positions": length}
    model = causal_lm(vocab_size=2000, config=config)
    ids = torch.randint(0, 2000, (batch, length))
    batch_of = lambda: {"input_ids": ids, "labels": ids}
    step = lambda b: model.train_step(b)["loss"]
else:
    import torchvision

    model = torchvision.models.resnet50(weights=None, num_classes=10)
    model.fsdp_blocks = ("BasicBlock", "Bottleneck")  # as expkit.models.torchvision_resnet declares
    size, batch = (32, 2) if quick else (128, 16)
    images, labels = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    batch_of = lambda: (images, labels)
    step = lambda b: nn.functional.cross_entropy(model(b[0]), b[1])


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


wrapped = len(apply(model, setting))
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
start_mb = rss_mb()
seconds, cpu_seconds, losses = [], [], []
for i in range(iters):
    began, began_cpu = time.perf_counter(), time.process_time()
    loss = step(batch_of())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
    seconds.append(time.perf_counter() - began)
    cpu_seconds.append(time.process_time() - began_cpu)
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT " + json.dumps({"peak_mb": peak_mb, "start_mb": start_mb, "seconds": seconds[1:],
                              "cpu_seconds": cpu_seconds[1:], "losses": losses, "wrapped": wrapped}))
"""


def run_once(workload: str, setting: str, iters: int, quick: bool, threads: int) -> dict:
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-c", CHILD, workload, setting, str(iters), "1" if quick else "0"]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{workload} {setting} failed:\n{out.stderr[-3000:]}")
    return json.loads(next(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")))


def per_iter(result: dict, key: str) -> float:
    """A run's peak RSS, or the median of its timed iterations' wall or CPU seconds."""
    return result[key] if key == "peak_mb" else statistics.median(result[key])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=4, help="iterations per run (the first is not timed)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--quick", action="store_true", help="1 round of tiny models: checks the script runs")
    args = parser.parse_args()
    rounds, iters = (1, 2) if args.quick else (args.rounds, max(args.iters, 2))
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); {args.threads} thread(s) a process")
    results: dict[tuple[str, str], list[dict]] = {}
    for index in range(rounds):
        for workload in ("gpt2", "resnet50"):
            for setting in ("off", "full") if index % 2 == 0 else ("full", "off"):
                result = run_once(workload, setting, iters, args.quick, args.threads)
                results.setdefault((workload, setting), []).append(result)
                losses = " ".join(f"{v:.4f}" for v in result["losses"])
                print(
                    f"round {index + 1} {workload:<8} {setting:<4} peak {result['peak_mb']:5.0f} MB "
                    f"(model built {result['start_mb']:4.0f} MB)  {per_iter(result, 'seconds'):6.3f} s/iter wall "
                    f"{per_iter(result, 'cpu_seconds'):6.3f} CPU  blocks {result['wrapped']}  losses {losses}  "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print(
        "| model | activation checkpointing | peak RSS min / median (MB) | wall s/iter min / median "
        "| CPU s/iter min / median | every round: peak MB, wall s, CPU s |"
    )
    print("|---|---|---:|---:|---:|---|")
    for (workload, setting), rows in results.items():
        peaks, walls, cpus = ([per_iter(r, key) for r in rows] for key in ("peak_mb", "seconds", "cpu_seconds"))
        every = "; ".join(f"{p:.0f}, {w:.2f}, {c:.2f}" for p, w, c in zip(peaks, walls, cpus))
        print(
            f"| {workload} | {setting} | {min(peaks):.0f} / {statistics.median(peaks):.0f} "
            f"| {min(walls):.3f} / {statistics.median(walls):.3f} | {min(cpus):.3f} / {statistics.median(cpus):.3f} "
            f"| {every} |"
        )
    print()
    for workload in ("gpt2", "resnet50"):
        off, on = results[(workload, "off")], results[(workload, "full")]
        ratio = {
            key: statistics.median(per_iter(r, key) for r in on) / statistics.median(per_iter(r, key) for r in off)
            for key in ("peak_mb", "seconds", "cpu_seconds")
        }
        same = all(a["losses"] == b["losses"] for a, b in zip(off, on))
        print(
            f"{workload}: full / off, medians: peak RSS {ratio['peak_mb']:.2f}x, time per iteration "
            f"{ratio['cpu_seconds']:.2f}x CPU, {ratio['seconds']:.2f}x wall; the same losses: {same}"
            + ("   (targets: <= 0.6x, <= 1.4x)" if workload == "gpt2" else "")
        )


if __name__ == "__main__":
    main()
