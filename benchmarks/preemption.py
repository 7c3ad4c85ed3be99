"""What a preemption costs a two-node run, on a real Slurm cluster of three nodes on this machine.

A plain ``sbatch --nodes=2 --requeue`` job (partition ``low``, on n2 and n3) runs
``srun python -m expkit.train`` (digits, 0.05 s an iteration so that it trains long enough),
and a job of the higher partition ``urgent`` (all of n3's CPUs, ``sleep 1``) preempts it,
``--preemptions`` times over. Slurm sends every rank SIGTERM; the run saves, requeues itself
(``expkit.core.slurm.being_requeued``) and resumes from that save. A hook records on rank 0 the
time of each training iteration and of the run's end; ``sacct --duplicates`` gives each
attempt's start (in whole seconds). Per preemption the table gives, in seconds: from the
``sbatch`` of the urgent job to the last iteration trained (Slurm's scheduling and its signal,
the iteration that was running), from there to the run's end (the save, the records), from
there to the next attempt's start (the exit; Slurm's requeue, which holds a requeued job back
for ``cred_expire``, 30 s on this cluster, and its scheduling), from the start to its first
iteration (start-up, rendezvous, loading the checkpoint), and in all; and the iterations trained
twice: those past the checkpoint the next attempt resumed from (target: 0).

    python benchmarks/preemption.py [--preemptions 3] [--dir DIR] [--json FILE] [--keep DIR]

Needs Slurm (``bash scripts/setup_slurm.sh install``, as root). Starts a cluster of its own in
DIR (``/tmp/expkit-preemption`` by default; port 7817, beside the tests' cluster) and stops it
at the end; with ``SLURM_CONF`` set, uses that cluster instead (one set up by
``scripts/setup_slurm.sh`` with three nodes or more: the tests' cluster, in
``tests/cluster/test_slurm_preemption.py``). Each preemption took 54-58 s with Slurm's default
60-s scheduling pass (2026-11-28); that cluster now passes every 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "scripts" / "setup_slurm.sh"
PORT = "7817"

TIMELINE_HOOK = """
import json, os, time
from expkit import Hook

class Timeline(Hook):
    # rank 0: [time.time(), iterations done, this attempt's restart count] after each training
    # iteration, and [time.time(), -1, restart count] once the run has ended (saved, hooks done)
    priority = "LOWEST"

    def after_train_iter(self, runner, **kwargs):
        time.sleep(0.05)
        self._write(runner, runner.iter + 1)

    def after_run(self, runner):
        self._write(runner, -1)

    def _write(self, runner, done):
        if os.environ.get("SLURM_PROCID", "0") == "0":
            with open(runner.work_dir / "timeline.jsonl", "a") as f:
                f.write(json.dumps([time.time(), done, int(os.environ.get("SLURM_RESTART_COUNT", "0"))]) + "\\n")
"""


def _cluster(command: str, where: Path) -> None:
    env = {**os.environ, "EXPKIT_SLURM_NODES": "3", "EXPKIT_SLURM_PORT": PORT}
    done = subprocess.run(["bash", str(SETUP), command, str(where)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"scripts/setup_slurm.sh {command} {where}: exit {done.returncode}\n{done.stdout}{done.stderr}")


def _slurm(env: dict[str, str], *command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def _cancel(env: dict[str, str], job: str) -> None:
    """scancel `job` and wait until it has left the queue (COMPLETING included: its processes are gone)."""
    subprocess.run(["scancel", job], env=env, capture_output=True)

    def gone() -> bool:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
        return done.returncode != 0 or not done.stdout.strip()

    _wait(f"job {job} to leave the queue", gone, timeout=120)


def _timeline(work: Path) -> list[tuple[float, int, int]]:
    path = work / "timeline.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(json.loads(line)) for line in lines if line.endswith("]")]  # type: ignore[misc]


def _attempts(env: dict[str, str], job: str) -> list[tuple[float, float | None]]:
    """(start, end) of each attempt of `job`, in order, as ``time.time()`` seconds (whole seconds:
    sacct's; end None while it runs)."""

    def seconds(stamp: str) -> float | None:
        try:
            return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return None

    out = _slurm(env, "sacct", "--duplicates", "-X", "-n", "-P", "-o", "Start,End,State", "-j", job)
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
    return [(s, seconds(e)) for s, e in ((seconds(a), b) for a, b, _ in rows) if s is not None]


def _wait(what: str, done, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preemptions", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/expkit-preemption"))
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--keep", type=Path, help="keep the run's work dir here (train.log, timeline.jsonl)")
    args = parser.parse_args()
    own = "SLURM_CONF" not in os.environ
    if own:
        _cluster("start", args.dir)
    conf = Path(os.environ.get("SLURM_CONF") or args.dir / "etc" / "slurm.conf")
    env = {**os.environ, "SLURM_CONF": str(conf), "OMP_NUM_THREADS": "1"}
    nodes = [
        line.split()[0].removeprefix("NodeName=")
        for line in conf.read_text().splitlines()
        if line.startswith("NodeName=")
    ]
    first, last = nodes[0], nodes[-1]  # (the job runs on the last two; the last is the urgent partition's)
    job, rows = None, []
    tmp = Path(tempfile.mkdtemp(prefix="expkit-preemption-"))
    try:
        (tmp / "timelinehook.py").write_text(TIMELINE_HOOK)
        work = args.keep or tmp / "run"
        train = [sys.executable, "-m", "expkit.train", f"hydra.run.dir={work}", "trainer.max_epochs=400"]
        train += ["+hooks.timeline._target_=timelinehook.Timeline", "default_hooks.logger.plot=false"]
        script = tmp / "job.sh"
        script.write_text("#!/bin/sh\nexec srun " + " ".join(train) + "\n")
        env["PYTHONPATH"] = str(tmp)
        job = _slurm(
            env,
            *["sbatch", "--parsable", "--requeue", "--partition=low", f"--exclude={first}", "--nodes=2"],
            *["--ntasks-per-node=1", "--cpus-per-task=1", "--mem=2G", "--time=60", f"--output={tmp}/job.out"],
            *[f"--chdir={REPO}", str(script)],
        ).strip()
        for n in range(args.preemptions):
            _wait(f"attempt {n} training", lambda n=n: sum(1 for *_, r in _timeline(work) if r == n) >= 40)
            sent = time.time()
            cpus = re.search(r"CPUTot=(\d+)", _slurm(env, "scontrol", "show", "node", last)).group(1)
            _slurm(
                env,
                *["sbatch", "--partition=urgent", f"--nodelist={last}", f"--cpus-per-task={cpus}", "--mem=500M"],
                *["--time=1", "--output=/dev/null", "--wrap=sleep 1"],
            )
            _wait(f"attempt {n + 1} training", lambda n=n: any(r == n + 1 for *_, r in _timeline(work)))
            timeline = _timeline(work)
            stopped = max((t, i) for t, i, r in timeline if r == n and i >= 0)  # (time, iterations done)
            ended = max(t for t, i, r in timeline if r == n and i < 0)
            again = min((t, i) for t, i, r in timeline if r == n + 1 and i >= 0)
            _wait(f"attempt {n + 1} in sacct", lambda n=n: len(_attempts(env, job)) > n + 1, timeout=60)
            started = _attempts(env, job)[n + 1][0]
            rows.append(
                {
                    "signal to the last iteration": stopped[0] - sent,
                    "to the run's end (saved, recorded)": ended - stopped[0],
                    "to the next start (exit; Slurm: requeue, schedule)": started - ended,
                    "to the first iteration (start-up, rendezvous, load)": again[0] - started,
                    "signal to training again": again[0] - sent,
                    "iterations trained twice": stopped[1] - (again[1] - 1),
                }
            )
    finally:
        try:
            if job:  # (before its dir goes: its ranks write there until they are gone)
                _cancel(env, job)
        finally:
            shutil.rmtree(tmp)
            if own:
                _cluster("stop", args.dir)
    if args.json:
        args.json.write_text(json.dumps(rows))
    print(
        f"preemptions of a two-node run (plain sbatch, srun; digits, 0.05 s an iteration); {time.strftime('%Y-%m-%d')}"
    )
    names = list(rows[0])
    print("| | " + " | ".join(f"#{i + 1}" for i in range(len(rows))) + " | min | median |")
    print("|---|" + "---:|" * (len(rows) + 2))
    for name in names:
        values = [row[name] for row in rows]
        cells = [f"{v:.1f}" if name != "iterations trained twice" else f"{v:.0f}" for v in values]
        print(f"| {name} | " + " | ".join(cells) + f" | {min(values):.1f} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
