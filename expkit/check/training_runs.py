"""The check's three training runs: real ``expkit.train`` processes (under torchrun when the
check runs under it), each with the probe added, started and waited for; the interrupted run
resumed once it killed itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from expkit.check.planning import Plan
from expkit.check.traces import KILL_AT_ENV, read_trace
from expkit.config import cli
from expkit.core.errors import ConfigError

__all__ = ["TORCHRUN_ENV", "Run", "RunFailed", "failed_runs", "last_error", "split_argv", "train_all"]

# the check's own torchrun variables, never its runs': a run started under them would join the
# check's process group instead of starting one of its own
TORCHRUN_ENV = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
}


class RunFailed(Exception):
    """A run of the check failed in a way no comparison can read (not the first: that is input)."""


@dataclass
class Run:
    """One run of the check and what its processes left.

    Args:
        name: ``a``, ``b`` or ``c``.
        work_dir: the run's work dir.
        returncodes: the exit status of each process started for it, in order.
        output: the processes' output (stdout and stderr), joined.
        seconds: the wall-clock time its processes took, in seconds.
    """

    name: str
    work_dir: Path
    returncodes: list[int] = field(default_factory=list)
    output: str = ""
    seconds: float = 0.0


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(what each training run gets: the flags and overrides as typed, less the check's own keys
    and the dirs the check chooses; refused keys) .

    Args:
        argv: the check's command line, without the program name.

    Returns:
        The arguments each training run gets (``check.*``, ``hydra.run.dir`` and
            ``hydra.output_subdir`` left out), and the refused ones (``-m``/``--multirun``,
            ``resume``, ``hydra.sweep.*``).
    """
    passed, refused, index = [], [], 0
    while index < len(argv):
        arg = argv[index]
        # a flag with a value (--config-dir DIR) passes as a pair: its value is no override
        if arg in cli.VALUED_FLAGS and index + 1 < len(argv):
            passed += [arg, argv[index + 1]]
            index += 2
            continue
        key = arg.partition("=")[0].lstrip("+~")
        if arg in ("-m", "--multirun"):
            refused.append(arg)
        elif key.split(".")[0] == "check" or key in ("hydra.run.dir", "hydra.output_subdir"):
            pass
        elif key in ("resume",) or key.startswith("hydra.sweep"):
            refused.append(arg)
        else:
            passed.append(arg)
        index += 1
    return passed, refused


def _run_overrides(run: Run, plan: Plan, *, resume: bool) -> list[str]:
    """What the check adds to a run's command line: its work dir, the probe, and a checkpoint at
    the interruption point that is never removed."""
    extra = [
        f"hydra.run.dir={run.work_dir}",
        "default_hooks.logger.progress=false",
        "+hooks.check_probe._target_=expkit.check.check_probe.CheckProbe",
        f"+hooks.check_probe.stop_at={plan.budget}",
    ]
    if plan.checkpoints:
        extra += [
            "default_hooks.checkpoint.by_epoch=false",
            f"default_hooks.checkpoint.interval={plan.kill_at}",
            "default_hooks.checkpoint.out_dir=null",
            "default_hooks.checkpoint.max_keep_ckpts=-1",
        ]
    if resume:
        extra.append("resume=true")
    if "mlflow" in plan.loggers:
        # a store of the check's own (the environment names it), no artifacts: MLflow would put
        # them in ./mlruns
        extra += ["logger.mlflow.tracking_uri=null", "logger.mlflow.artifacts=false"]
    return extra


def _run_environment(plan: Plan, *, kill: bool) -> dict[str, str]:
    """The environment of a run's processes: the check's own, less its torchrun variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != KILL_AT_ENV and k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")
    }
    # the check's runs are not the user's: never synced
    env["WANDB_MODE"] = "offline"
    if "mlflow" in plan.loggers:
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{plan.scratch / 'mlflow.db'}"
    if kill:
        env[KILL_AT_ENV] = str(plan.kill_at)
    env["HYDRA_FULL_ERROR"] = "0"
    # three runs at once share the cores: torch's threads each (all the cores by default) would
    # contend, spinning (a recurrent model trained 4x slower here); every run gets the same count
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (3 * plan.nproc))))
    return env


def _start(run: Run, argv: list[str], plan: Plan, *, resume: bool = False, kill: bool = False) -> subprocess.Popen:
    """One ``expkit.train`` process of the check, its output to a file in the scratch dir."""
    extra = _run_overrides(run, plan, resume=resume)
    env = _run_environment(plan, kill=kill)
    run.work_dir.parent.mkdir(parents=True, exist_ok=True)
    sink = open(run.work_dir.parent / f"{run.name}{len(run.returncodes)}.out", "w+")  # noqa: SIM115  (closed in _wait)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={plan.nproc}"]
    python = launcher if plan.nproc > 1 else [sys.executable]
    proc = subprocess.Popen(
        [*python, "-m", "expkit.train", *cli.flags_first([*argv, *extra])],
        env=env,
        stdout=sink,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.sink, proc.started = sink, time.perf_counter()  # type: ignore[attr-defined]
    return proc


def _wait(run: Run, proc: subprocess.Popen) -> int:
    returncode = proc.wait()
    run.seconds += time.perf_counter() - proc.started  # type: ignore[attr-defined]
    proc.sink.seek(0)  # type: ignore[attr-defined]
    run.output += proc.sink.read()  # type: ignore[attr-defined]
    proc.sink.close()  # type: ignore[attr-defined]
    run.returncodes.append(returncode)
    return returncode


def train_all(runs: dict[str, Run], argv: list[str], plan: Plan) -> None:
    """a, b and the interrupted c at once (most of each is start-up, on one core), then c's
    resume. A run that does not even start (the first error of the experiment) stops it all.

    Args:
        runs: the runs by name (``a``, ``b``, ``c``); their return codes and output are filled in.
        argv: the training runs' arguments (``split_argv``).
        plan: the plan.

    Raises:
        ConfigError: when run ``a`` exits 2 (bad input).
        RunFailed: when run ``a`` fails otherwise.
    """
    procs = {"a": _start(runs["a"], argv, plan), "b": _start(runs["b"], argv, plan)}
    if plan.checkpoints:
        procs["c"] = _start(runs["c"], argv, plan, kill=True)
    try:
        for name, proc in procs.items():
            _wait(runs[name], proc)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # expkit.train exits 2 for bad input: the user's, as the check's own would be
    if runs["a"].returncodes[-1] == 2:
        raise ConfigError(last_error(runs["a"]).removeprefix("Error: "))
    if runs["a"].returncodes[-1] != 0:
        raise RunFailed(f"the experiment does not train: {last_error(runs['a']).removeprefix('Error: ')}")
    # c killed itself (under torchrun, which then exits 1, as when a rank is lost): resume it
    if plan.checkpoints and read_trace(runs["c"].work_dir).killed:
        _wait(runs["c"], _start(runs["c"], argv, plan, resume=True))


def last_error(run: Run) -> str:
    """What a failed run said last: its last ``Error`` line, else its last five lines.

    Args:
        run: the run, its processes waited for.

    Returns:
        The line(s); ``exit N`` when the run said nothing.
    """
    lines = [ln for ln in run.output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error")]
    return (errors[-1] if errors else "\n".join(lines[-5:])) or f"exit {run.returncodes[-1]}"


def failed_runs(runs: dict[str, Run]) -> list[Run]:
    """The runs whose last process failed; c's first process, killed on purpose, is no failure.

    Args:
        runs: the runs by name, trained (``train_all``).

    Returns:
        The failed runs, in order.
    """
    return [
        r
        for r in runs.values()
        if r.returncodes
        and r.returncodes[-1] != 0
        and not (r.name == "c" and len(r.returncodes) == 1 and read_trace(r.work_dir).killed)
    ]
