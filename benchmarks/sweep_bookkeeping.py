"""Sweep bookkeeping at cluster scale: what each job of a sweep spends on the sweep's records
(finding its dir on resume, the summary) in a sweep dir holding thousands of job dirs, against
the same in a small sweep; and the full rebuild (``python -m expkit.sweep``).

It runs a real 3-job sweep, copies its job 0 into N - 3 more job dirs (each its own identity,
result and curve), then times, in interleaved rounds, the same 3-job command with
``resume=true`` (the 3 jobs are found, already completed, and summarized) in the small sweep
dir and in the big one. Per-job bookkeeping = (big - small) / 3.

    python benchmarks/sweep_bookkeeping.py [--jobs 5000] [--rounds 3]

Targets: per-job bookkeeping under 0.1 s more than in a small sweep; the full rebuild of
the big sweep dir under 10 s, process start included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRID = ["optim.lr=0.1,0.05,0.01", "trainer.max_epochs=1"]


def run(*args: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"}
    )
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def clone_jobs(sweep: Path, total: int) -> None:
    """Job dirs 3..total-1: copies of job 0 with their own overrides, identity and values."""
    source = sweep / "0"
    for n in range(3, total):
        target = sweep / str(n)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("checkpoints", "*.log", "tb"))
        lr = f"optim.lr={0.001 + n * 1e-6:.6f}"
        overrides = [lr, "trainer.max_epochs=1"]
        (target / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        job = json.loads((target / "job.json").read_text())
        job["overrides"] = sorted(overrides)
        job["hydra"]["overrides.yaml"] = (target / ".hydra" / "overrides.yaml").read_text()
        (target / "job.json").write_text(json.dumps(job))
        result = json.loads((target / "result.json").read_text())
        result["work_dir"] = str(target)
        result["best_metrics"]["val/acc"]["value"] = 0.5 + (n % 1000) / 10000
        (target / "result.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="job dirs in the big sweep")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small, big = Path(tmp) / "small", Path(tmp) / "big"
        run("-m", "expkit.train", "-m", *GRID, f"hydra.sweep.dir={small}")
        shutil.copytree(small, big)
        clone_jobs(big, args.jobs)
        run("-m", "expkit.sweep", str(big), "--quiet")  # the copies' rows cached, as their own ends would have
        os.sync()  # the copies on disk before timing (their writeback would land in the first round)
        print(f"sweep dirs: {small} (3 jobs), {big} ({args.jobs} jobs)")
        times: dict[str, list[float]] = {"small": [], "big": [], "rebuild": []}
        for _ in range(args.rounds):  # interleaved: the machine's noise hits both sides alike
            for name, sweep in (("small", small), ("big", big)):
                times[name].append(run("-m", "expkit.train", "-m", *GRID, f"hydra.sweep.dir={sweep}", "resume=true"))
            times["rebuild"].append(run("-m", "expkit.sweep", str(big), "--quiet"))
        rows = len(list(csv_rows(big / "summary.csv")))
        if rows != args.jobs:
            sys.exit(f"summary.csv of the big sweep has {rows} rows, expected {args.jobs}")
    for name, values in times.items():
        print(
            f"{name:8s} "
            + " ".join(f"{v:6.2f}" for v in values)
            + f"   min {min(values):6.2f} s  median {statistics.median(values):6.2f} s"
        )
    per_job = [(b - s) / 3 for b, s in zip(times["big"], times["small"])]
    print(
        f"per-job bookkeeping in {args.jobs} job dirs vs 3: min {min(per_job):+.3f} s, "
        f"median {statistics.median(per_job):+.3f} s  (target < 0.1 s)"
    )
    print(
        f"full rebuild of {args.jobs} job dirs, process start included: min {min(times['rebuild']):.2f} s, "
        f"median {statistics.median(times['rebuild']):.2f} s  (target < 10 s)"
    )


def csv_rows(path: Path):
    import csv

    with path.open() as f:
        yield from csv.DictReader(f)


if __name__ == "__main__":
    main()
