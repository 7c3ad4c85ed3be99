"""Searches that never wait: trials of unequal length, K=2 at a time in joblib workers, against
the ideal (the jobs' total time / K).

Each round runs the same 16 jobs (50 and 200 epochs of the default MLP, about 2 s and 7.5 s
here, alternating; trainer.seed 0-7; --epochs to change) three ways:
- batches: Hydra's batch-synchronous way (the basic sweeper with max_batch_size=K): a batch
  of K starts when the slowest job of the batch before it has ended. expkit's Optuna sweeper
  ran its trials this way before it had slots (n_jobs trials asked, launched, waited for).
- optuna slots: expkit's Optuna sweeper, n_jobs=K: a slot that frees asks the study for the
  next trial at once (the study's first trials enqueued in the same order as the grid).
- grid, one launch: the basic sweeper with every job in one launch (joblib hands a job to a
  worker as soon as it is free).
A job's time is read from its own records: from its .hydra/config.yaml (Hydra writes it when
the job starts, its config composed) to its result.json (written last). The ratio is the span
from the first job's start to the last job's end, over the ideal: the sum of the jobs' times
/ K. What happens between one job and the next on a slot (the study's ask and tell, handing
the job to a worker, composing its config there) counts against the ratio. Target for the
Optuna slots: <= 1.15x. That gap costs about 0.3 s a trial here, so short trials read worse:
with 1 and 4 epochs, as first planned, a trial takes 0.05-0.15 s and the ratio measures the
dispatch, not the barrier (benchmarks/README.md has the figures for 25 and 100 epochs too).

    python benchmarks/sweep_async.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K = 2
SHORT, LONG = 50, 200


def _span(sweep: Path) -> tuple[float, float]:
    """(first start to last end, the jobs' summed time) of every job dir of `sweep`."""
    spans = []
    for job in (p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()):
        spans.append(((job / ".hydra" / "config.yaml").stat().st_mtime, (job / "result.json").stat().st_mtime))
    return max(e for _, e in spans) - min(s for s, _ in spans), sum(e - s for s, e in spans)


def _enqueue(storage: str, seeds: int, short: int, long: int) -> None:
    import optuna

    from expkit.sweeps.search import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="bench", storage=open_storage(storage), direction="maximize")
    for seed in range(seeds):
        for epochs in (short, long):
            study.enqueue_trial({"trainer.seed": seed, "trainer.max_epochs": epochs})


def _run(name: str, tmp: Path, seeds: int, short: int, long: int, env: dict[str, str]) -> tuple[float, float, float]:
    """One way: (span / ideal, span, the sweep's wall time)."""
    sweep = tmp / name.replace(",", "").replace(" ", "_")
    common = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={K}", f"hydra.sweep.dir={sweep}"]
    grid = [f"trainer.seed={','.join(map(str, range(seeds)))}", f"trainer.max_epochs={short},{long}"]
    if name == "batches":
        args = ["-m", *grid, f"hydra.sweeper.max_batch_size={K}", *common]
    elif name == "grid, one launch":
        args = ["-m", *grid, *common]
    else:
        storage = str(tmp / "bench.journal")
        _enqueue(storage, seeds, short, long)
        args = [
            "hparams_search=optuna",
            f"hydra.sweeper.n_trials={2 * seeds}",
            f"hydra.sweeper.n_jobs={K}",
            f"hydra.sweeper.storage={storage}",
            "hydra.sweeper.study_name=bench",
            f"trainer.seed=choice({','.join(map(str, range(seeds)))})",
            f"trainer.max_epochs=choice({short},{long})",
            *common,
        ]
    start = time.time()
    subprocess.run([sys.executable, "-m", "expkit.train", *args], capture_output=True, check=True, env=env)
    wall = time.time() - start
    span, total = _span(sweep)
    return span / (total / K), span, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3, help="repetitions, the three ways interleaved")
    parser.add_argument("--epochs", type=int, nargs=2, default=[SHORT, LONG], metavar=("SHORT", "LONG"))
    parser.add_argument("--quick", action="store_true", help="4 short jobs, 1 round, for CI: checks the script runs")
    args = parser.parse_args()
    seeds, short, long = (2, 1, 4) if args.quick else (8, *args.epochs)
    rounds = 1 if args.quick else args.rounds
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # (as startup.py)
    ways = ["batches", "optuna slots", "grid, one launch"]
    ratios: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(rounds):
        for way in ways:
            with tempfile.TemporaryDirectory() as tmp:
                ratio, span, wall = _run(way, Path(tmp), seeds, short, long, env)
            ratios[way].append(ratio)
            print(
                f"round {r + 1}: {way:17s} {2 * seeds} jobs ({short} and {long} epochs), {K} at once: "
                f"{ratio:.3f}x the ideal (jobs' span {span:.1f} s; sweep wall {wall:.1f} s)",
                flush=True,
            )
    for way in ways:
        v = ratios[way]
        target = "   target <= 1.15x" if way == "optuna slots" else ""
        print(
            f"{way:17s} against the ideal: min {min(v):.3f}x  median {statistics.median(v):.3f}x   "
            f"(rounds: {' '.join(f'{x:.3f}' for x in v)}){target}"
        )


if __name__ == "__main__":
    main()
