"""Instructions per epoch, expkit against the raw loop, on the peer workload of peers.py.

Timing a 0.7 s run on a shared machine moves by several percent from one invocation to the
next; instruction counts do not. Each side runs under valgrind's cachegrind (no cache
simulation) twice, for a short and a long run; the difference between the two, divided by
the extra epochs, is what one epoch costs: 40 training iterations, one validation, one
checkpoint, every hook. Start-up and imports cancel out. Prints each side's instructions per
epoch and per training iteration, and expkit's ratio and excess.

    python benchmarks/loop_instructions.py [--epochs 1 5] [--keep DIR] [--cache-sim [--ll BYTES]] [--hash-seeds 0 1 2]

``--keep DIR`` keeps the cachegrind files (``cg_annotate DIR/expkit-5.out``) to see which C
functions the excess runs in. Needs valgrind (``apt-get install valgrind``); each run takes
one to two minutes under it. ``--cache-sim`` also simulates the caches and prints the first-level
instruction and data misses and the last-level data misses an epoch (each run about twice as long);
``--ll 2097152`` simulates the last level as one core's 2 MB L2 (this machine's), where the training's
working set (weights, gradients, momentum: about 1 MB) has to stay. Every run has the same
``PYTHONHASHSEED`` (0), so that dict and set layouts, hence the counts, repeat; the misses depend
on where the allocator puts the tensors, which the hash seed moves, so ``--hash-seeds 0 1 2 3``
runs each side under each seed and prints every seed's figures and their median.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from peers import EXPKIT, RAW, run_once

SIDES = {"raw loop": RAW, "expkit": EXPKIT}
# --part train: the training iterations alone (no validation, no checkpoint on either side)
TRAIN_ONLY = {
    "raw loop": RAW.replace("    model.eval()\n", "    continue\n").replace("correct / total)", "0.0)"),
    "expkit": EXPKIT.replace(
        "from expkit import Runner, TrainerSettings", "from expkit import Runner, TrainerSettings, default_hooks"
    )
    .replace("val_loader=val,", "default_hooks=default_hooks(checkpoint=None),")
    .replace('result["final_metrics"]["val/acc"]', "0.0"),
}
ITERATIONS_PER_EPOCH = 40  # ceil(1257 / 32): the peer workload's training batches


# cachegrind's summary lines (stderr), first number: instructions, and with --cache-sim=yes the
# first-level instruction and data cache misses and the last-level data misses
COUNTERS = {
    "instructions": "I refs",
    "L1 instruction misses": "I1 misses",
    "L1 data misses": "D1 misses",
    "last-level data misses": "LLd misses",
}


def instructions(
    code: str,
    epochs: int,
    work: Path,
    out_file: Path,
    cache_sim: bool = False,
    last_level: int | None = None,
    hash_seed: int = 0,
) -> dict[str, int]:
    """What the whole process ran for a run of `epochs`: cachegrind's ``I refs`` as
    ``instructions``, and with `cache_sim` its simulated cache misses (``COUNTERS``); `last_level`: the
    simulated last-level cache's size in bytes (16-way, 64-byte lines) instead of valgrind's guess;
    `hash_seed`: the run's ``PYTHONHASHSEED``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # the same hash seed every run: dict and set layouts, hence the instruction counts, repeat
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED=str(hash_seed), PYTHONPATH=str(Path(__file__).parent))
    run_dir = Path(tempfile.mkdtemp(dir=work))
    script = run_dir / "side.py"  # (a file, not -c: cg_annotate reads the command as one line)
    script.write_text(code)
    command = [
        "valgrind",
        "--tool=cachegrind",
        f"--cache-sim={'yes' if cache_sim else 'no'}",
        *([f"--LL={last_level},16,64"] if cache_sim and last_level else []),
        f"--cachegrind-out-file={out_file}",
        sys.executable,
        str(script),
        str(epochs),
        str(run_dir),
    ]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=run_dir, timeout=1800)
    found = {}
    for name, label in COUNTERS.items():
        line = re.search(label.replace(" ", r"\s+") + r":\s+([\d,]+)", out.stderr)
        if line is not None:
            found[name] = int(line.group(1).replace(",", ""))
    if out.returncode != 0 or "instructions" not in found or "RESULT" not in out.stdout:
        raise RuntimeError(f"exit {out.returncode}: {out.stderr[-2000:]}")
    return found


def quick() -> None:
    """What CI can afford: every side of both parts runs one epoch (natively), and
    cachegrind's count of a trivial program is read back."""
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for part, sides in (("whole", SIDES), ("train", TRAIN_ONLY)):
            for name, code in sides.items():
                run_once(code, 1, tmp)  # (raises, naming the exit status and stderr, when a side fails)
                print(f"{part}, {name}: ran")
        count = instructions("print('RESULT')", 0, tmp, tmp / "count.out")["instructions"]
        print(f"cachegrind read: {count:,} instructions for a Python that prints one line")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, nargs=2, default=(1, 5), metavar=("SHORT", "LONG"))
    parser.add_argument(
        "--part",
        choices=("whole", "train"),
        default="whole",
        help="train: the training iterations alone, no validation or checkpoint on either side",
    )
    parser.add_argument("--keep", type=Path, help="keep the cachegrind output files in this dir")
    parser.add_argument(
        "--cache-sim",
        action="store_true",
        help="also simulate the caches: L1 instruction and data misses and last-level data misses an epoch (slower)",
    )
    parser.add_argument(
        "--ll",
        type=int,
        metavar="BYTES",
        help="with --cache-sim: the last level simulated as this many bytes (2097152: one core's L2 here, "
        "where the training's working set lives), instead of valgrind's guess from the CPU (the shared L3)",
    )
    parser.add_argument(
        "--hash-seeds",
        type=int,
        nargs="+",
        default=[0],
        metavar="SEED",
        help="run each side under each PYTHONHASHSEED and print each seed's figures and their median (default: 0)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seconds, for CI: each side once without valgrind, valgrind's count read once",
    )
    args = parser.parse_args()
    short, long = args.epochs
    if long <= short:
        parser.error("--epochs SHORT LONG: LONG must be greater than SHORT")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed: apt-get install valgrind")
    if args.quick:
        quick()
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        keep = args.keep or tmp
        keep.mkdir(parents=True, exist_ok=True)
        sides = SIDES if args.part == "whole" else TRAIN_ONLY
        for code in sides.values():  # not counted: writes the byte-code caches, as peers.py does
            run_once(code, 1, tmp)
        per_seed = []  # per seed: {side: {counter: per epoch}}
        for seed in args.hash_seeds:
            per_side = {}
            for name, code in sides.items():
                tag = name.split()[0] + (f"-seed{seed}" if len(args.hash_seeds) > 1 else "")
                counts = [
                    instructions(code, e, tmp, keep / f"{tag}-{e}.out", args.cache_sim, args.ll, seed)
                    for e in (short, long)
                ]
                per_side[name] = {k: (counts[1][k] - counts[0][k]) / (long - short) for k in counts[1]}
                print(
                    f"{name} (PYTHONHASHSEED={seed}): {counts[0]['instructions']:,} instructions for {short} "
                    f"epoch(s), {counts[1]['instructions']:,} for {long}",
                    flush=True,
                )
            per_seed.append(per_side)
    _report(per_seed, args.hash_seeds, args.part)


def _report(per_seed: list[dict[str, dict[str, float]]], seeds: list[int], part: str) -> None:
    """Instructions an epoch and iteration, expkit's ratio and excess, and each counter's ratio:
    for each hash seed when there are several, then their medians."""
    import statistics

    def median(side: str, counter: str) -> float:
        return statistics.median(run[side][counter] for run in per_seed)

    raw, ours = median("raw loop", "instructions"), median("expkit", "instructions")
    what = "+ a validation + a checkpoint" if part == "whole" else "(no validation, no checkpoint)"
    print(f"\npeer workload, one epoch = {ITERATIONS_PER_EPOCH} training iterations {what}")
    print("| side | instructions per epoch | per training iteration |")
    print("|---|---:|---:|")
    for name in per_seed[0]:
        value = median(name, "instructions")
        print(f"| {name} | {value:,.0f} | {value / ITERATIONS_PER_EPOCH:,.0f} |")
    print(
        f"\nexpkit / raw loop: {ours / raw:.4f}x; excess {ours - raw:,.0f} instructions per epoch, "
        f"{(ours - raw) / ITERATIONS_PER_EPOCH:,.0f} per training iteration"
        + (f" (medians over PYTHONHASHSEED {', '.join(map(str, seeds))})" if len(seeds) > 1 else "")
    )
    for counter in (c for c in per_seed[0]["raw loop"] if c != "instructions"):  # (--cache-sim)
        each = ""
        if len(seeds) > 1:
            ratios = [
                f"{run['expkit'][counter] / run['raw loop'][counter]:.4f}x" if run["raw loop"][counter] else "-"
                for run in per_seed
            ]
            each = f"; by seed {', '.join(f'{s}: {r}' for s, r in zip(seeds, ratios, strict=True))}"
        theirs, mine = median("raw loop", counter), median("expkit", counter)
        ratio = f" ({mine / theirs:.4f}x)" if theirs else ""
        print(f"{counter} per epoch: raw loop {theirs:,.0f}, expkit {mine:,.0f}{ratio}{each}")


if __name__ == "__main__":
    main()
