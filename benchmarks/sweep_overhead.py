"""Sweep overhead: an 8-job multirun of short jobs; the per-job time beyond training itself
(wall time of the sweep, minus one process start-up, minus the jobs' own run times from
their result.json), divided by 8. Target: under 0.5 s per job.

    python benchmarks/sweep_overhead.py [--jobs 8]
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
    args = parser.parse_args()
    values = ",".join(str(0.1 / (i + 1)) for i in range(args.jobs))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        subprocess.run([sys.executable, "-m", "expkit.train", "show_hooks=true", f"hydra.run.dir={tmp}/startup"],
                       capture_output=True, check=True)  # fmt: skip
        startup = time.time() - start
        start = time.time()
        subprocess.run([sys.executable, "-m", "expkit.train", "-m", f"optim.lr={values}", "trainer.max_epochs=1",
                        f"hydra.sweep.dir={tmp}/sweep"], capture_output=True, check=True)  # fmt: skip
        wall = time.time() - start
        runs = [json.loads((Path(tmp) / "sweep" / str(j) / "result.json").read_text())["wall_time_s"]
                for j in range(args.jobs)]  # fmt: skip
    overhead = (wall - startup - sum(runs)) / args.jobs
    print(f"{args.jobs} jobs of 1 epoch: sweep wall {wall:.2f} s, process start-up {startup:.2f} s, "
          f"jobs' own run time {sum(runs):.2f} s")  # fmt: skip
    print(f"overhead per job beyond training: {overhead:.3f} s   (target < 0.5 s)")


if __name__ == "__main__":
    main()
