"""Why an epoch gets slower through a CPU run, and what ``trainer.flush_denormal`` buys.

The peer workload of peers.py (MLP on digits, SGD with momentum 0.9, one thread), 40 epochs.
A ReLU unit that stops firing gets zero gradients, and its momentum buffer's entries shrink by
0.9 a step: after some 800 steps they reach fp32's denormal range (below 1.2e-38) and stay in it
(0.9 times a few units of the last place rounds back to the same few), and an x86 CPU computes
on denormals through a slow microcode path. The
weights and the loss are the same either way; only the time moves. Four variants, each in its
own process, rounds interleaved (``_table.round_order``): the raw loop, the raw loop with
``torch.set_flush_denormal(True)``, expkit, expkit with ``flush_denormal=True``. Prints, per
variant, the median epoch time of the first five and of the last five epochs, the whole run
(min and median), the denormal entries left in the momentum buffers at the end, and val/acc;
then expkit's excess over the raw loop, paired by round, without flushing and with it on both.

    python benchmarks/denormals.py [--rounds 3] [--epochs 40] [--quick]

The RESULT, EPOCHS and DENORMALS lines come from each variant's process (``peers.run_tagged``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _table import ratios, round_order
from peers import EXPKIT, RAW, run_tagged

# counts the momentum buffers' denormal entries (nonzero, below fp32's smallest normal)
COUNT = """
def denormals(optimizer):
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((b != 0) & (b.abs() < tiny)).sum()) for s in optimizer.state.values() for b in s.values()
               if isinstance(b, torch.Tensor) and b.is_floating_point())
"""
FLUSH = "torch.set_num_threads(1)\ntorch.set_flush_denormal(True)\n"

RAW_STAMPED = (
    RAW.replace(
        "for epoch in range(EPOCHS):\n",
        "STAMPS = []\nfor epoch in range(EPOCHS):\n    STAMPS.append(time.perf_counter())\n",
    ).replace(
        "report(time.perf_counter() - start", "STAMPS.append(time.perf_counter())\nreport(time.perf_counter() - start"
    )
    + COUNT
    + 'print("EPOCHS", " ".join(str(b - a) for a, b in zip(STAMPS, STAMPS[1:])))\n'
    + 'print("DENORMALS", denormals(opt))\n'
)
EXPKIT_STAMPED = (
    EXPKIT.replace(
        "model = make_net()\n",
        """from expkit.hooks import Hook
STAMPS = []
class Stamp(Hook):
    priority = "HIGHEST"
    def before_train_epoch(self, runner):
        STAMPS.append(time.perf_counter())
    def after_train(self, runner):
        STAMPS.append(time.perf_counter())
model = make_net()
""",
    ).replace('device="cpu", seed=None)', 'device="cpu", seed=None, flush_denormal=FLUSH), hooks=[Stamp()]')
    + COUNT
    + 'print("EPOCHS", " ".join(str(b - a) for a, b in zip(STAMPS, STAMPS[1:])))\n'
    + 'print("DENORMALS", denormals(runner.optimizer))\n'
)
VARIANTS = {
    "raw loop": RAW_STAMPED,
    "raw loop, flushing": RAW_STAMPED.replace("torch.set_num_threads(1)\n", FLUSH, 1),
    "expkit": EXPKIT_STAMPED.replace("flush_denormal=FLUSH", "flush_denormal=False"),
    "expkit, flush_denormal=true": EXPKIT_STAMPED.replace("flush_denormal=FLUSH", "flush_denormal=True"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 round of 24 epochs, the first denormals included: checks the script (CI)",
    )
    args = parser.parse_args()
    rounds, epochs = (1, 24) if args.quick else (args.rounds, args.epochs)
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, str]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for r in range(rounds):
            for name in round_order(names, r):
                tags = ("RESULT", "EPOCHS", "DENORMALS")
                runs[name].append(run_tagged(VARIANTS[name], epochs, tmp, tags, keep=False))
    print(
        f"peer workload (peers.py), {epochs} epochs, 1 thread, CPU; {rounds} interleaved rounds, each variant its own process"
    )
    print(
        "| variant | epochs 1-5, median ms | last 5 epochs, median ms | whole run min s | median s "
        "| denormals in the momentum at the end | val/acc |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    seconds = {name: [float(run["RESULT"].split()[0]) for run in runs[name]] for name in names}
    for name in names:
        epoch_ms = [[float(t) * 1e3 for t in run["EPOCHS"].split()] for run in runs[name]]
        if any(len(e) != epochs for e in epoch_ms):
            raise RuntimeError(f"{name}: {[len(e) for e in epoch_ms]} epochs stamped, not {epochs}")
        first = statistics.median(t for e in epoch_ms for t in e[:5])
        last = statistics.median(t for e in epoch_ms for t in e[-5:])
        denormals = {run["DENORMALS"] for run in runs[name]}
        accuracy = {f"{float(run['RESULT'].split()[1]):.4f}" for run in runs[name]}
        print(
            f"| {name} | {first:.1f} | {last:.1f} | {min(seconds[name]):.3f} | {statistics.median(seconds[name]):.3f} "
            f"| {' '.join(sorted(denormals))} | {' '.join(sorted(accuracy))} |"
        )
    print()
    for plain, framework, label in (
        ("raw loop", "expkit", "without flushing"),
        ("raw loop, flushing", "expkit, flush_denormal=true", "both flushing"),
    ):
        excess = [(e - r) * 1e3 for e, r in zip(seconds[framework], seconds[plain])]
        paired = ratios(seconds[framework], seconds[plain])[2]
        print(
            f"expkit over the raw loop, {label}, paired by round: {statistics.median(excess):+.1f} ms median "
            f"({min(excess):+.1f} to {max(excess):+.1f}), {paired:.3f}x"
        )


if __name__ == "__main__":
    main()
