"""What ``python -m expkit.check`` costs: its whole wall time against one plain ``expkit.train``
run of the same experiment and the same budget (the iterations the check trains each run,
start-up included). Target: at most 4x (the check trains three runs, one of them in two
processes, and starts a fourth process; it runs the first three at once).

Interleaved rounds, per experiment: the check, then the plain run stopped at the check's
budget (``stop_after``, as the check's own stop). Prints every invocation, minimum and median.

    python benchmarks/check_cost.py [--rounds 2] [--experiments default digits_cnn ...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED = ["default"] + sorted(p.stem for p in (REPO / "expkit" / "conf" / "experiment").glob("*.yaml"))


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - start


def _runs(xs: list[float]) -> str:
    return " ".join(f"{x:.1f}" for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experiments", nargs="*", default=SHIPPED)
    parser.add_argument("--quick", action="store_true", help="one round of the default experiment, 6 iterations (CI)")
    args = parser.parse_args()
    budget_args = ["check.iters=6"] if args.quick else []
    if args.quick:
        args.rounds, args.experiments = 1, ["default"]
    print(f"{'experiment':<14} {'iters':>5}  {'plain run':>22}  {'check':>22}  {'check / plain':>15}")
    for name in args.experiments:
        exp = [] if name == "default" else [f"experiment={name}"]
        checks, plains, budget = [], [], 0
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                report = Path(tmp) / "check.json"
                checks.append(
                    _timed(
                        [
                            sys.executable,
                            "-m",
                            "expkit.check",
                            *exp,
                            f"check.out={report}",
                            f"check.dir={tmp}",
                            *budget_args,
                        ]
                    )
                )
                budget = json.loads(report.read_text())["budget"]
                plains.append(
                    _timed(
                        [
                            sys.executable,
                            "-m",
                            "expkit.train",
                            *exp,
                            f"hydra.run.dir={tmp}/plain",
                            "+hooks.stop_after._target_=expkit.hooks.StopAfterHook",
                            f"+hooks.stop_after.iters={budget}",
                            "default_hooks.logger.progress=false",
                        ]
                    )
                )
        print(
            f"{name:<14} {budget:>5}  min {min(plains):5.1f} med {statistics.median(plains):5.1f} s  "
            f"min {min(checks):5.1f} med {statistics.median(checks):5.1f} s  "
            f"{min(checks) / min(plains):5.2f}x {statistics.median(checks) / statistics.median(plains):5.2f}x"
            f"   (plain: {_runs(plains)}; check: {_runs(checks)})"
        )
    print("target: check / plain <= 4x (min/min, median/median)")


if __name__ == "__main__":
    main()
