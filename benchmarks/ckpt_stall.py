"""How long a checkpoint save stops the training loop: synchronous saves against
``default_hooks.checkpoint.async_save=true``, on a model and AdamW state of ResNet-50 size.

Real ``expkit.train`` runs of torchvision's ResNet-50 (23.5M parameters, 10 classes) with AdamW
on the embedded digits, saving every few iterations. Two probe hooks bracket the checkpoint hook
in ``after_train_iter`` (priority 89 and LOWEST, around its VERY_LOW): the time between them at
an iteration that saves is what the loop waits for. Synchronous: the whole ``torch.save`` and
the rename. Asynchronous: the copy of the state into host buffers (the write runs in the
background; a save that had to wait for the previous write shows that wait too).

Interleaved rounds (a synchronous run, then an asynchronous one); prints every save, minimum
and median. Target: the asynchronous stall at most 10% of the synchronous save (minimum and
median).

    python benchmarks/ckpt_stall.py [--rounds 3] [--saves 4] [--interval 6] [--fsync] [--quick]
                                    [--sharded] [--nproc N]

``--sharded`` saves sharded checkpoints (``trainer.strategy=fsdp``: DCP; async through
``torch.distributed.checkpoint.async_save``); ``--nproc 2`` runs under torchrun (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import json, time
from expkit import Hook


class Before(Hook):
    priority = 89  # just before the checkpoint hook (VERY_LOW, 90)

    def __init__(self):
        self.t0 = 0.0

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        self.t0 = time.perf_counter()


class After(Hook):
    priority = "LOWEST"

    def __init__(self, interval: int, out: str):
        self.interval, self.out, self.stalls = interval, out, []

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if (runner.iter + 1) % self.interval == 0:
            before = next(h for h in runner.hooks if type(h).__name__ == "Before")
            self.stalls.append(time.perf_counter() - before.t0)

    def after_train(self, runner):
        if not runner.is_main:
            return
        with open(self.out, "w") as f:
            json.dump(self.stalls, f)
"""


def _run(
    tmp: Path, mode: str, arch: str, interval: int, saves: int, index: int, fsync: bool, sharded: bool, nproc: int
) -> list[float]:
    out = tmp / f"stalls_{mode}_{index}.json"
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    command = [
        sys.executable,
        *launch,
        "-m",
        "expkit.train",
        f"trainer.strategy={'fsdp' if sharded else 'ddp'}",
        f"hydra.run.dir={tmp / f'{mode}_{index}'}",
        "model=resnet18",
        f"model.arch={arch}",
        "optim=adamw",
        "trainer.max_epochs=1",
        "default_hooks.checkpoint.by_epoch=false",
        f"default_hooks.checkpoint.interval={interval}",
        "default_hooks.checkpoint.max_keep_ckpts=1",
        "default_hooks.checkpoint.save_best=null",
        "default_hooks.checkpoint.save_last=false",
        f"default_hooks.checkpoint.async_save={mode == 'async'}",
        "default_hooks.logger.progress=false",
        "default_hooks.logger.plot=false",
        "+hooks.stop_after._target_=expkit.hooks.StopAfterHook",
        f"+hooks.stop_after.iters={interval * saves}",
        "+hooks.before._target_=stallprobe.Before",
        "+hooks.after._target_=stallprobe.After",
        f"+hooks.after.interval={interval}",
        f"+hooks.after.out={out}",
        "trainer.test_with=last",
        f"default_hooks.checkpoint.fsync={fsync}",
    ]
    env = {**os.environ, "PYTHONPATH": str(tmp), **({"OMP_NUM_THREADS": "1"} if nproc > 1 else {})}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ckpt_stall: the {mode} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def _ms(xs: list[float]) -> str:
    return " ".join(f"{x * 1e3:.0f}" for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4, help="saves per run")
    parser.add_argument("--interval", type=int, default=6, help="iterations between saves")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument(
        "--fsync", action="store_true", help="default_hooks.checkpoint.fsync=true: each file forced to disk"
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="trainer.strategy=fsdp: sharded (DCP) checkpoints, async through DCP's async_save",
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes (torchrun, gloo); the stalls are rank 0's")
    parser.add_argument("--quick", action="store_true", help="one round, ResNet-18, 2 saves (CI)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.saves, args.arch = 1, 2, "resnet18"
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "stallprobe.py").write_text(PROBE)
        how = (", sharded (DCP)" if args.sharded else "") + (f", {args.nproc} processes" if args.nproc > 1 else "")
        print(
            f"{args.arch} + AdamW, a save every {args.interval} iterations, {args.saves} saves a run, "
            f"{args.rounds} interleaved rounds{', fsync=true' if args.fsync else ''}{how}; stall per save in ms"
        )
        for index in range(args.rounds):
            for mode in ("sync", "async"):
                run = _run(tmp, mode, args.arch, args.interval, args.saves, index, args.fsync, args.sharded, args.nproc)
                stalls[mode] += run
                print(f"round {index + 1} {mode:<5}  {_ms(run)}")
    sync, background = stalls["sync"], stalls["async"]
    print(f"synchronous save    min {min(sync) * 1e3:7.1f} ms  median {statistics.median(sync) * 1e3:7.1f} ms")
    print(
        f"asynchronous stall  min {min(background) * 1e3:7.1f} ms  median {statistics.median(background) * 1e3:7.1f} ms"
    )
    print(
        f"async / sync: min/min {min(background) / min(sync):.3f}  "
        f"median/median {statistics.median(background) / statistics.median(sync):.3f}  (target <= 0.10)"
    )


if __name__ == "__main__":
    main()
