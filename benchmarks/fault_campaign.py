"""Fault campaign: kill real runs with SIGKILL at random moments, resume them, and count how
many end bit-identical to an uninterrupted run with consistent records.

Each trial starts `python -m expkit.train` (slowed by a hook so kills land anywhere: in
training, in validation, inside a checkpoint write), kills it after a random delay, resumes
it with `resume=true` (killing the resume too, with probability --rekill), and compares with
one uninterrupted reference run:
  weights      the final checkpoint's state_dict, bit for bit
  metrics      metrics.jsonl without timing fields: the same records in the same order
  tensorboard  the scalars read back
  result       result.json's status, epoch, iter, final and best metrics
  temporaries  no .tmp file left

    python benchmarks/fault_campaign.py [--trials 20] [--seed 0] [--rekill 0.3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TIMING = ("train/time", "train/data_time")
COMMON = [
    "default_hooks.checkpoint.by_epoch=false",
    "default_hooks.checkpoint.interval=7",
    "default_hooks.logger.interval=5",
    "logger=[tensorboard]",
]
SLOW_HOOK = """
import time
from expkit import Hook

class Slow(Hook):
    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        time.sleep(0.02)

    def after_val_iter(self, runner, *, batch_idx, data_batch, outputs):
        time.sleep(0.02)
"""


def _train(work: Path, conf: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expkit.train",
            "--config-dir",
            str(conf),
            "hooks=[slow]",
            f"hydra.run.dir={work}",
            *COMMON,
            *extra,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(conf.parent), "HYDRA_FULL_ERROR": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill_after(proc: subprocess.Popen, seconds: float) -> bool:
    """SIGKILL after `seconds` unless it ended first; True when it was killed."""
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _records(work: Path) -> list[dict]:
    lines = (work / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def _scalars(work: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {
        t: [(e.step, e.value) for e in events.Scalars(t)]
        for t in events.Tags()["scalars"]
        if t.startswith(("train/loss", "val/", "test/"))
    }


def _result(work: Path) -> dict:
    result = json.loads((work / "result.json").read_text())
    return {k: result.get(k) for k in ("status", "epoch", "iter", "final_metrics", "best_metrics")}


def compare(work: Path, reference: Path) -> dict[str, bool]:
    final = max((work / "checkpoints").glob("iter_*.pth"), key=lambda p: int(p.stem.split("_")[1]))
    expected = reference / "checkpoints" / final.name
    a, b = (torch.load(p, weights_only=True)["state_dict"] for p in (final, expected))
    return {
        "weights": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
        "metrics": _records(work) == _records(reference),
        "tensorboard": _scalars(work) == _scalars(reference),
        "result": _result(work) == _result(reference),
        "temporaries": not list(work.rglob("*.tmp*")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="the kill times' random seed")
    parser.add_argument("--rekill", type=float, default=0.3, help="probability of killing the resume as well")
    parser.add_argument("--quick", action="store_true", help="2 trials of 2-epoch runs (what the test suite runs)")
    args = parser.parse_args(argv)
    trials = 2 if args.quick else args.trials
    epochs = f"trainer.max_epochs={2 if args.quick else 3}"  # a kill still lands in either epoch
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        conf = root / "conf"
        (conf / "hooks").mkdir(parents=True)
        (conf / "hooks" / "slow.yaml").write_text("slow:\n  _target_: slowhook.Slow\n")
        (root / "slowhook.py").write_text(SLOW_HOOK)
        reference = root / "reference"
        started = time.perf_counter()
        if _train(reference, conf, epochs).wait() != 0:
            print("the reference run failed", file=sys.stderr)
            return 1
        duration = time.perf_counter() - started
        print(f"reference run: {duration:.1f} s; {trials} trials, kills at uniform random times in it")
        good = 0
        for trial in range(trials):
            work = root / f"trial{trial}"
            kills = int(_kill_after(_train(work, conf, epochs), rng.uniform(0.3, 1.0) * duration))
            while rng.random() < args.rekill and _kill_after(
                _train(work, conf, epochs, "resume=true"), rng.uniform(0.2, 0.8) * duration
            ):
                kills += 1
            code = _train(work, conf, epochs, "resume=true").wait()
            checks = compare(work, reference) if code == 0 else {"resume exit 0": False}
            ok = all(checks.values())
            good += ok
            failed = ", ".join(k for k, v in checks.items() if not v) or "-"
            print(f"trial {trial}: {kills} kill(s), {'consistent' if ok else 'DIFFERS'} (failed: {failed})")
    print(f"{good} of {trials} trials ended bit-identical with consistent records")
    return 0 if good == trials else 1


if __name__ == "__main__":
    sys.exit(main())
