"""Sweep overhead: an 8-job multirun of short (1-epoch) jobs against the same job run alone.

Two figures, both per job:
- the issue's definition: (sweep wall time - 8 x one job's wall time as its own process) / 8.
  Negative means the sweep is cheaper than separate runs (one process start-up, not eight).
- the strict one: (sweep wall time - one process start-up - the jobs' own run times from
  their result.json) / 8: everything Hydra and expkit add per job (composing the job's
  config, its .hydra/ files, provenance, checkpoints' bookkeeping, the summary after every
  job, sweep.svg at the end).
Target: under 0.2 s per job (the strict figure).

    python benchmarks/sweep_overhead.py [--jobs 8] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _round(jobs: int, tmp: Path, env: dict[str, str]) -> tuple[float, float, float, float]:
    """One job alone, then the sweep: (single wall, single run time, sweep wall, jobs' run time)."""
    values = ",".join(str(0.1 / (i + 1)) for i in range(jobs))
    start = time.time()
    subprocess.run(
        [sys.executable, "-m", "expkit.train", "optim.lr=0.1", "trainer.max_epochs=1", f"hydra.run.dir={tmp}/single"],
        capture_output=True,
        check=True,
        env=env,
    )
    single = time.time() - start
    single_run = json.loads((tmp / "single" / "result.json").read_text())["wall_time_s"]
    start = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.train",
            "-m",
            f"optim.lr={values}",
            "trainer.max_epochs=1",
            f"hydra.sweep.dir={tmp}/sweep",
        ],
        capture_output=True,
        check=True,
        env=env,
    )
    wall = time.time() - start
    runs = sum(json.loads((tmp / "sweep" / str(j) / "result.json").read_text())["wall_time_s"] for j in range(jobs))
    return single, single_run, wall, runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--quick", action="store_true", help="2 jobs, 1 round, for CI: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.rounds = 2, 1
    # as on a user's machine: byte-code caches on (see startup.py)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    issue, strict = [], []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            single, single_run, wall, runs = _round(args.jobs, Path(tmp), env)
        startup = single - single_run
        issue.append((wall - args.jobs * single) / args.jobs)
        strict.append((wall - startup - runs) / args.jobs)
        print(
            f"round {r + 1}: {args.jobs} jobs of 1 epoch: sweep wall {wall:.2f} s; one job alone {single:.2f} s "
            f"(start-up {startup:.2f} s + run {single_run:.2f} s); the sweep's jobs' own run time {runs:.2f} s"
        )
    print(
        f"per job, against {args.jobs} separate runs: min {min(issue):+.3f} s  median {statistics.median(issue):+.3f} s   "
        f"(rounds: {' '.join(f'{v:+.3f}' for v in issue)})"
    )
    print(
        f"overhead per job beyond training (strict): min {min(strict):.3f} s  median {statistics.median(strict):.3f} s   "
        f"(rounds: {' '.join(f'{v:.3f}' for v in strict)})   target < 0.2 s"
    )


if __name__ == "__main__":
    main()
