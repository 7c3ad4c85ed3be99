"""Memory per rank, trainer.strategy=ddp against trainer.strategy=fsdp, under torchrun.

The same run both ways (an MLP of a few million parameters on digits, AdamW, 2 CPU processes
with gloo, 20 iterations), interleaved rounds, each in fresh processes. Per rank it prints:

- state: the bytes of training state the rank holds after its last step (its parameters,
  gradients and optimizer state: under FSDP its shards), counted exactly from the tensors;
- peak: the rank process's peak resident memory (ru_maxrss) above its resident memory when
  the model is built, i.e. what training adds (on a GPU it would be max_memory_allocated).

    python benchmarks/fsdp_memory.py [--rounds 3] [--width 2048] [--nproc 2] [--quick]

The sharded run must hold less: its state is about 1/N of DDP's (plus the unsharded
parameters of one block at a time, gathered for forward and backward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = '''
import json, os, resource
import torch
from expkit import Hook


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MemoryProbe(Hook):
    """Records, per rank, the RSS before training, the bytes of training state held at the end
    (parameters, gradients, optimizer state: local shards) and the peak RSS."""

    def before_run(self, runner):
        self.start_mb = _rss_mb()

    def after_train(self, runner):
        held = 0
        for p in runner.model.parameters():
            held += _local(p).numel() * p.element_size()
            if p.grad is not None:
                held += _local(p.grad).numel() * p.grad.element_size()
        for opt in runner.optimizers.values():
            for state in opt.state.values():
                held += sum(_local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rank = int(os.environ.get("RANK", "0"))
        (runner.work_dir / f"memory_rank{rank}.json").write_text(json.dumps(
            {"state_mb": held / 2**20, "peak_above_start_mb": peak_mb - self.start_mb, "peak_mb": peak_mb}))
'''


def run_once(strategy: str, width: int, nproc: int, iters: int, tmp: Path, index: int) -> list[dict[str, float]]:
    work = tmp / f"{strategy}_{index}"
    # large blocks straight from (and back to) the OS: glibc's default lets freed 16 MB buffers
    # linger in its heap, and peak RSS would measure fragmentation rather than live tensors
    env = {**os.environ, "PYTHONPATH": str(tmp), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    hidden = f"[{width},{width},{width}]"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "expkit.train",
            f"hydra.run.dir={work}",
            f"trainer.strategy={strategy}",
            f"model.hidden={hidden}",
            "optim=adamw",
            f"trainer.max_iters={iters}",
            "trainer.val_interval=100000",
            "default_hooks.checkpoint.interval=-1",
            "default_hooks.checkpoint.save_last=false",
            "default_hooks.logger.plot=false",
            "trainer.test_with=last",
            "+hooks.memory._target_=memprobe.MemoryProbe",
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return [json.loads((work / f"memory_rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the 3 hidden layers")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 round, a narrower model: checks the script runs")
    args = parser.parse_args()
    rounds, width, iters = (1, 512, 4) if args.quick else (args.rounds, args.width, 20)
    params = 64 * width + 2 * width * width + width * 10 + 3 * width + 10
    print(
        f"MLP 64-{width}-{width}-{width}-10 ({params / 1e6:.2f} M parameters), AdamW, {args.nproc} processes "
        f"(gloo, CPU), {iters} iterations, {rounds} interleaved rounds"
    )
    results: dict[str, list[list[dict[str, float]]]] = {"ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "memprobe.py").write_text(PROBE)
        for index in range(rounds):
            for strategy, rounds_of in results.items():
                rounds_of.append(run_once(strategy, width, args.nproc, iters, tmp, index))
    for key, label in (("state_mb", "state held"), ("peak_above_start_mb", "peak RSS above start")):
        print(f"\n{label} per rank (MB): every round; min / median over rounds and ranks")
        summary = {}
        for strategy, rows in results.items():
            values = [rank[key] for row in rows for rank in row]
            summary[strategy] = (min(values), statistics.median(values))
            each = "  ".join("[" + ", ".join(f"{rank[key]:.1f}" for rank in row) + "]" for row in rows)
            print(f"  {strategy:<5} {each}   min {summary[strategy][0]:.1f}  median {summary[strategy][1]:.1f}")
        ratio = summary["fsdp"][1] / summary["ddp"][1]
        print(f"  fsdp / ddp (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
