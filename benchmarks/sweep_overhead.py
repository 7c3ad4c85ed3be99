"""Sweep overhead: an 8-job multirun of short (1-epoch) jobs against the same job run alone.

Two figures, both per job:
- the issue's definition: (sweep wall time - 8 x one job's wall time as its own process) / 8.
  Negative means the sweep is cheaper than separate runs (one process start-up, not eight).
- the strict one: (sweep wall time - one process start-up - the jobs' own run times from
  their result.json) / 8: everything Hydra and expkit add per job (composing the job's
  config, its .hydra/ files, provenance, checkpoints' bookkeeping, the summary after every
  job, sweep.svg at the end).
Target: under 0.5 s per job.

    python benchmarks/sweep_overhead.py [--jobs 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 jobs, for CI: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.jobs = 2
    values = ",".join(str(0.1 / (i + 1)) for i in range(args.jobs))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        subprocess.run([sys.executable, "-m", "expkit.train", "optim.lr=0.1", "trainer.max_epochs=1",
                        f"hydra.run.dir={tmp}/single"], capture_output=True, check=True)  # fmt: skip
        single = time.time() - start
        single_run = json.loads((Path(tmp) / "single" / "result.json").read_text())["wall_time_s"]
        startup = single - single_run
        start = time.time()
        subprocess.run([sys.executable, "-m", "expkit.train", "-m", f"optim.lr={values}", "trainer.max_epochs=1",
                        f"hydra.sweep.dir={tmp}/sweep"], capture_output=True, check=True)  # fmt: skip
        wall = time.time() - start
        runs = [json.loads((Path(tmp) / "sweep" / str(j) / "result.json").read_text())["wall_time_s"]
                for j in range(args.jobs)]  # fmt: skip
    print(f"{args.jobs} jobs of 1 epoch: sweep wall {wall:.2f} s; one job alone {single:.2f} s "
          f"(start-up {startup:.2f} s + run {single_run:.2f} s); the sweep's jobs' own run time {sum(runs):.2f} s")
    print(f"per job, against {args.jobs} separate runs: {(wall - args.jobs * single) / args.jobs:+.3f} s")
    print(f"overhead per job beyond training (strict): {(wall - startup - sum(runs)) / args.jobs:.3f} s   (target < 0.5 s)")


if __name__ == "__main__":
    main()
