"""Whole 2-process torchrun runs (gloo, CPU), one after another: every completed run must exit 0.

A rank whose process group outlives ``destroy_process_group`` into the interpreter's teardown
can abort there ("terminate called without an active exception", SIGABRT), after its run
completed; torchrun then reports the run failed (or restarts it). ``tests/distributed/test_process_exit.py``
checks the cause directly (no group left at exit); this loop shows the effect over many runs.
Runs alternate ``trainer.strategy=ddp`` and ``fsdp`` (with ``async_save``: DCP's own groups),
one epoch each, through ``tests/conftest.py``'s ``torchrun`` helper.

    python benchmarks/torchrun_exits.py [--runs 20] [--quick]

Prints every run (strategy, exit status, seconds, whether a rank aborted) and the count that
exited 0; exits 1 when any did not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import torchrun

STRATEGIES = (
    ("ddp", ["trainer.strategy=ddp"]),
    ("fsdp", ["trainer.strategy=fsdp", "default_hooks.checkpoint.async_save=true"]),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="torchrun runs, alternating ddp and fsdp")
    parser.add_argument("--quick", action="store_true", help="two runs (one of each), for the test suite")
    args = parser.parse_args()
    runs = 2 if args.quick else args.runs
    ok = 0
    with tempfile.TemporaryDirectory(prefix="expkit-torchrun-exits-") as scratch:
        for n in range(runs):
            name, strategy = STRATEGIES[n % len(STRATEGIES)]
            work = Path(scratch) / f"{n}-{name}"
            began = time.perf_counter()
            proc = torchrun(
                "trainer.max_epochs=1",
                "data.batch_size=67",
                "default_hooks.logger.plot=false",
                f"hydra.run.dir={work}",
                *strategy,
                cwd=Path(scratch),
            )
            aborted = "terminate called" in proc.output
            ok += proc.returncode == 0 and not aborted
            print(
                f"run {n + 1:2d}/{runs}  {name:4s}  exit {proc.returncode:3d}  {time.perf_counter() - began:5.1f} s"
                + ("  a rank aborted (terminate called)" if aborted else ""),
                flush=True,
            )
            if proc.returncode != 0:
                print(proc.output[-2000:], flush=True)
    print(f"exited 0: {ok} of {runs} ({ok / runs:.3f})")
    sys.exit(0 if ok == runs else 1)


if __name__ == "__main__":
    main()
