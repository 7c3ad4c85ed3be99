"""``python -m expkit.train``: compose the config, build, run, report the work dir.

Bad input exits with status 2 and one message naming the key and the valid choices;
a failed run exits with status 1, and its result.json says ``failed`` with the error;
a run stopped by SIGTERM / SIGINT saves a checkpoint and exits with 128 + the signal
number (143 / 130), result.json saying ``stopped``; so does one stopped by its requeue signal
(``trainer.requeue_signal``: 138 after USR1), and one that stopped itself before its Slurm time
limit (``trainer.save_before_limit``) exits 3; under Slurm both have their job requeued first.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from expkit.config import cli
from expkit.core import atomic, hydra_compat, versions
from expkit.core.errors import ConfigError, ExpkitError, ResumeRefused, counted, exit_status, task_exits
from expkit.core.signals import (
    SweepInterrupted,
    hold_sigterm,
    quiet_ctrl_c,
    raise_on_sigterm,
    release_sigterm,
    stop_on_signals,
    submitit_signal,
    take_ctrl_c,
)
from expkit.loggers import logs
from expkit.metrics import monitor_of, worst_value
from expkit.sweeps import sweep_jobs
from expkit.workdir.records import read_result
from expkit.workdir.results import write_failure

__all__ = ["main", "run", "task_overrides"]


log = logging.getLogger("expkit")

EXIT_REQUEUED = 3  # a single run that stopped itself before its Slurm time limit (trainer.save_before_limit), or that Slurm requeues

# The shipped Optuna search's TPE sampler sets constant_liar, which Optuna 4 calls experimental (a
# warning on every search, while Hydra builds the sweeper); Optuna 5 does not. That warning only, set
# here: Hydra's plugin scan, which imports the sweeper, restores the warning filters it found.
warnings.filterwarnings("ignore", message=r"Argument ``constant_liar`` is an experimental feature")


# -- the task ---------------------------------------------------------------------------------------
def task_overrides(hc: Any) -> list[str]:
    """The command line's overrides as typed: an override holding ``${...}`` stays text (read
    through the list, OmegaConf would resolve it, before ``${data_info:...}`` is known).

    Args:
        hc: the Hydra config of the running job (``HydraConfig.get()``).

    Returns:
        The task overrides (``hydra.overrides.task``), unresolved, as strings.
    """
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.to_container(hc.overrides.task, resolve=False)]  # type: ignore[union-attr]


def _fail(exc: BaseException, work_dir: Path) -> None:
    """Report a user error in a single run: one message, result.json says failed; no traceback
    wall. A refused resume writes nothing in a run it names, which stays as it was; in a dir that
    holds no run yet (``load_from=`` or ``resume=`` of a missing file, into a fresh dir) the
    failure is recorded, so that every dir a command made says what became of it."""
    holds_a_run = any((work_dir / name).exists() for name in ("result.json", "metrics.jsonl", "checkpoints"))
    if not isinstance(exc, ResumeRefused) or not holds_a_run:
        write_failure(work_dir, str(exc))
    print(f"\nError: {exc}\n(work dir: {work_dir})", file=sys.stderr)
    sys.exit(2 if isinstance(exc, ConfigError) else 1)  # 2: fix the input; 1: the run failed


@hydra_compat.main(config_path="conf", config_name="train")
def run(cfg: DictConfig) -> float | None:
    """Hydra's task function: returns the best value of ``monitor`` for sweepers (never NaN:
    a failed or diverged job in a sweep returns the worst value).

    Args:
        cfg: the composed ``train.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Returns:
        The best value of ``monitor``. In a sweep: a job already finished or done returns its
            value, a failed, diverged, never validated or skipped job the worst value for the rule,
            and a job not started (the sweep was stopped, or another launch runs it) None. Outside a
            sweep: None when the run never validated or ``show_hooks=true`` only printed the table.

    Raises:
        SystemExit: outside a sweep, with status 2 for bad input, 1 for a failed run, and
            128 + the signal number for a run stopped by SIGTERM or SIGINT.
        SweepInterrupted: in the launching process of a sweep, when a signal stopped this job
            (``main`` reports the sweep).
        Exception: in a sweep with ``fail_fast=true``, the failed job's own error, re-raised once
            the failure is recorded.
    """
    with task_exits():  # (its SystemExits are the task's own; main makes Hydra's own 1 a 2)
        return _task(cfg)


@dataclass
class _Job:
    """One call of the task: where it writes, what it reports, and (in a sweep) its sweep."""

    cfg: DictConfig
    work_dir: Path
    sweep_dir: Path | None  # None: a single run, not a job of a sweep
    monitor: str
    rule: str  # the monitored key's direction (min or max), as known before the run
    run_info: dict[str, Any]  # what the run records of its command (result.json, wandb, MLflow)
    held: logs.HeldFileRecords | None = None  # a resume's log records, until its checkpoint fits
    requeue: bool = False  # the run stopped to be continued: the job is requeued once it is recorded
    reported: bool = (
        False  # a single run returned and was reported: Ctrl-C and SIGTERM are ignored once its handlers go
    )


def _task(cfg: DictConfig) -> float | None:
    """The task: the job described, owned, built, run and reported (see ``run``)."""
    from omegaconf import OmegaConf

    from expkit.core import distributed

    logs.errors_in_one_line()
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun and cfg.get("sweep_output", "progress") != "full":
        logs.quiet_terminal()  # (every line still goes to the job's train.log)
    joins = distributed.world_size() > 1 and not distributed.is_distributed()  # (torchrun joined in main already)
    work_dir = Path(hc.runtime.output_dir)
    if distributed.init():  # a submitit job with several tasks
        logs.log_to_rank_file(work_dir, distributed.rank())
        logs.errors_in_one_line()
    monitor, rule = monitor_of(OmegaConf.to_container(cfg, resolve=False))  # type: ignore[arg-type]
    run_info = _run_info(cfg, hc, work_dir)
    requeues = distributed.requeue_count() or (_submitit_requeues(work_dir, hc) if multirun else 0)
    if requeues > 0:
        run_info["requeues"] = requeues
    if requeues > 0 and (not sweep_jobs.resuming_sweep(cfg) if multirun else _resumes_own_dir(cfg, work_dir)):
        from omegaconf import open_dict  # requeued (preemption, a time limit, a failed node)

        with open_dict(cfg):  # a sweep's job finds its dir by its overrides; an sbatch script's run has the
            cfg.resume = True  # hydra.run.dir its srun line gives (a fresh dir: nothing to resume, it trains)
        log.info(
            "Requeue %d: resuming this %s from its last complete checkpoint", requeues, "job" if multirun else "run"
        )
    job = _Job(cfg, work_dir, Path(hc.sweep.dir) if multirun else None, monitor, rule, run_info)
    if hydra_compat.RECORD_DEFERRED.get() and not multirun:  # (refused, it leaves train.log as it was too)
        job.held = logs.HeldFileRecords()
    ran: Any = None
    try:
        with contextlib.ExitStack() as owned:  # the work dir's lock, the signal handlers: released on the way out
            if multirun:
                claim = sweep_jobs.claim_job(cfg, hc, task_overrides(hc), (job.monitor, job.rule), run_info, owned)
                if claim.work_dir is None:
                    return claim.value
                job.work_dir = claim.work_dir
            else:
                _lock_run_dir(job, owned)
            ran = _build_and_run(job, owned)
            if not isinstance(ran, tuple):
                return ran
            value = _report(job, *ran)
            job.reported = not multirun  # (settled as its handlers go; a run that stopped or failed has exited)
        return value
    finally:
        if job.held is not None:
            job.held.release()
        # the requeue comes last (the run is recorded and its dir's lock released for the next
        # attempt); submitit's ends this process, so it comes after the group is left
        handing_over = job.requeue and submitit_signal() is not None
        if job.requeue and not handing_over:
            _requeue()  # (rank 0's scontrol requeue)
        if isinstance(ran, tuple):  # every rank ran to the end: none leaves before rank 0 is done
            distributed.leave_together()
        if joins:  # the task's process ends with it: leave the group while the interpreter lives (see shutdown)
            distributed.shutdown()
        if handing_over:
            _requeue()


# (signal, its handler) before a completed single run made SIGINT and SIGTERM no-ops (``_settle``);
# main puts them back
_SETTLED: list[tuple[int, Any]] = []


def _settle() -> None:
    """A single run is complete and recorded: a Ctrl-C from here on (the group left, Hydra's end, the
    collector's pass over the run's objects: about a second) would report it interrupted, exit 130
    and print a traceback, with result.json saying completed; a SIGTERM would end the process with
    143, which says "stopped, resume it" (a requeue-on-143 wrapper would run it again). Both are
    ignored until ``main`` returns, and during the interpreter's teardown after it."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            _SETTLED.append((sig, signal.signal(sig, signal.SIG_IGN)))


def _resumes_own_dir(cfg: DictConfig, work_dir: Path) -> bool:
    """Whether a single run that Slurm requeued continues from its own dir's last checkpoint: yes
    unless its command resumes from a checkpoint file (``resume=<path>``) and the dir has none of
    its own yet (the requeue came before the first save: that file is still where it starts)."""
    from expkit.checkpoint.checkpoint_io import find_last_checkpoint
    from expkit.core import distributed

    if str(cfg.get("resume")).lower() in ("none", "false", "true"):
        return True
    # rank 0's answer on every rank (each rank reads the dir: one could see another listing, over NFS)
    return bool(distributed.broadcast_object(distributed.is_main() and find_last_checkpoint(work_dir) is not None))


def _run_info(cfg: DictConfig, hc: Any, work_dir: Path) -> dict[str, Any]:
    """What the run records of its command: overrides, hooks, command line, and how it was
    restarted (a Slurm requeue, torchrun's restarts)."""
    from expkit.core import distributed

    multirun = hc.mode == RunMode.MULTIRUN
    run_info: dict[str, Any] = {
        "overrides": task_overrides(hc),
        "hooks": [k for k, v in cfg.hooks.items() if v is not None and "_target_" in v],  # (not in runtime.choices)
        "command": shlex.join([*cli.command_words("expkit.train"), *sys.argv[1:]]),
    }
    if multirun and "SUBMITIT_EXECUTOR" in os.environ:  # (a requeued attempt knows its job by it)
        run_info["submitit_job"] = str(hc.job.id)
    if distributed.is_distributed() and not multirun:  # a rank's death is told with the way back
        run_info["resume_command"] = cli.continue_command(sys.argv[1:], work_dir)
        run_info["restarts"] = distributed.restart_count()  # torchrun --max-restarts
    return run_info


def _submitit_requeues(work_dir: Path, hc: Any) -> int:
    """A submitit job that submitit requeued outside Slurm (its local executor starts the job's
    command again, with nothing in the environment to say so): its dir's result.json says a
    requeue signal stopped it, and names this same submitit job. Under Slurm,
    ``SLURM_RESTART_COUNT`` says it first.

    Returns:
        The number of the requeue: one more than the stopped attempt's; 0 for a first attempt.
    """
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return 0
    result = read_result(work_dir)
    if (
        result is None
        or result.get("status") != "stopped"
        or not str(result.get("stop_reason") or "").startswith(("signal", "interrupted"))
        or result.get("submitit_job") != str(hc.job.id)
    ):
        return 0
    earlier = result.get("requeues")
    return (earlier if isinstance(earlier, int) else 0) + 1


def _requeue() -> None:
    """The run stopped to be continued (a requeue signal, or its time limit near): a submitit job
    gets submitit's signal back (submitit checkpoints the job, requeues it and ends this process);
    a job the user submitted to Slurm is requeued with ``scontrol requeue`` by rank 0. When
    neither can be, the run stays stopped and ``resume=true`` continues it."""
    from expkit.core import distributed, slurm
    from expkit.core.signals import hand_over, submitit_signal

    submitit = submitit_signal()
    if submitit is not None:
        why = hand_over(submitit)
    elif not distributed.is_main():
        return
    elif slurm.job_id() is None:
        why = "not a Slurm job"
    else:
        why = slurm.requeue()
        if why is None:
            log.info("Requeued Slurm job %s: its next start resumes this run", slurm.job_id())
    if why is not None:
        log.warning("Not requeued (%s); resume=true continues this run from its last checkpoint", why)


def _lock_run_dir(job: _Job, owned: contextlib.ExitStack) -> None:
    """One writer per run dir: this process's lock in `owned` (torchrun's other ranks share
    rank 0's); exits 2 when another process holds it, 1 when it cannot be written."""
    from expkit.core import distributed
    from expkit.workdir.ownership import WorkDirBusy, WorkDirLock

    if not distributed.is_main():
        return
    try:
        owned.enter_context(WorkDirLock(job.work_dir, job.run_info["command"]))
    except WorkDirBusy as exc:  # nothing written: the dir is another process's
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:  # a full or read-only disk
        print(f"Error: could not write {job.work_dir / '.lock'}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(1)


def _build_and_run(job: _Job, owned: contextlib.ExitStack) -> tuple[Any, dict[str, Any]] | float | None:
    """Build the Runner from the config and run it: (runner, result), or the value the task
    returns without a result (``show_hooks=true``, a sweep stopped meanwhile, a failed job of a
    sweep). A failure outside a sweep exits: 2 for bad input, 1 for a failed run."""
    from expkit.checkpoint import run_checkpoint
    from expkit.config.build import build_runner
    from expkit.core import distributed
    from expkit.core.rng import flush_denormals
    from expkit.sweeps import search

    cfg, work_dir, multirun = job.cfg, job.work_dir, job.sweep_dir is not None
    runner = None
    try:
        try:
            trial = search.current_trial() if multirun else None  # a job of an Optuna search
        except search.StorageUnreachable as exc:  # not failed: resume=true runs it (its worker stops too)
            log.error("Not started: %s", exc)
            write_failure(work_dir, str(exc), status="stopped", keep=False, stop_reason=f"{search.UNREACHABLE}: {exc}")
            return None
        if trial is not None:
            job.run_info["optuna_trial"] = trial[1]
        if cfg.trainer.get("flush_denormal") is True:  # (any other value: TrainerSettings names the key)
            owned.enter_context(flush_denormals(True))  # before the model's first op starts torch's threads
        runner = build_runner(cfg, work_dir, job.run_info)
        if hydra_compat.RECORD_DEFERRED.get():  # a resume: its checkpoint fits, .hydra/ may change now
            if not multirun:  # (a sweep made so by its config: its jobs check nothing more here)
                run_checkpoint.check_start(runner)
            _write_hydra_record(cfg, work_dir)
            if job.held is not None:
                job.held.keep()
        if not multirun:  # what building imported (torch._dynamo, with the optimizer) and built lives on too;
            _freeze_heap()  # (not in a sweep: jobs sharing a process must leave nothing frozen behind)
            # signals stay stop requests until the run is reported: torchrun SIGTERMs a dead rank's survivors
            # as they fail, and must not cut their error line; once the handlers are put back (the exit of
            # `owned` runs the callback after them), a reported run settles at once: a Ctrl-C after its
            # last line, while the lock is released, no longer finds the default handler
            owned.callback(lambda: job.reported and _settle())
            owned.enter_context(stop_on_signals(runner))
        if trial is not None:
            runner.register_hook(search.TrialReportHook(*trial))
        if cfg.show_hooks:
            print(runner.hook_order_table())
            return None
        if multirun and not sweep_jobs.may_start(job.sweep_dir):  # type: ignore[arg-type]  # (a stop while it was being built)
            return None
        return runner, runner.run()
    except Exception as exc:
        if multirun:
            rule = (runner.directions.rule(job.monitor) if runner is not None else None) or job.rule  # (its own)
            error = runner.error if runner is not None else None
            return sweep_jobs.job_failed(exc, work_dir, job.sweep_dir, rule, bool(cfg.fail_fast), error)  # type: ignore[arg-type]
        if isinstance(exc, ExpkitError):
            _fail(exc, work_dir)
        message = (runner.error if runner is not None else None) or f"{type(exc).__name__}: {exc}"
        if runner is None and distributed.is_main():  # failed while building: the Runner wrote no result.json
            write_failure(work_dir, message, keep=False, with_traceback=True, **job.run_info)
        print(f"\nError: {message}\n(traceback in {work_dir / 'result.json'})", file=sys.stderr)
        sys.exit(1)


def _report(job: _Job, runner: Any, result: dict[str, Any]) -> float | None:
    """The end of a run that returned: its summary logged, and the value the task returns (the
    best monitored value; in a sweep never NaN, the worst value instead). A run a signal stopped
    exits 128 + the signal (a single run) or stops the sweep (in the launching process)."""
    multirun = job.sweep_dir is not None
    best = result["best_metrics"].get(job.monitor)
    rule = result.get("monitor_rule") or job.rule
    segment = result.get("segment_wall_time_s")
    took = f"{result['wall_time_s']:.1f} s" + (f" ({segment:.1f} s since the resume)" if segment is not None else "")
    log.info("Done (%s) in %s: %s", result["status"], took, _done_metrics(result))
    log.info("Work dir: %s", job.work_dir.resolve())
    job.requeue = runner.requeue and result["status"] == "stopped"
    restarts = _slurm_restarts_it(runner, result, multirun)  # (every rank of a Slurm job: rank 0 asks for all)
    if runner.stopped_by_signal and result["status"] == "stopped":  # (not one after the end)
        only_this_job = not multirun or _stops_only_this_job(runner)
        if only_this_job and restarts:
            # No return value in a sweep: submitit would hand the sweep this attempt's stopped result
            # as the job's. Without one, the sweep's submitit goes on waiting for the job's next start.
            log.info("Slurm is requeuing this job (scontrol requeue, a preemption): its next start resumes the run")
            sys.exit(EXIT_REQUEUED)
        if not multirun:
            log.info("Stopped by a signal; continue with: %s", cli.continue_command(sys.argv[1:], job.work_dir))
            sys.exit(128 + runner.stop_signal)  # the shell's convention: 143 after SIGTERM, 130 after Ctrl-C
        if not only_this_job:
            sweep_jobs.request_stop(job.sweep_dir, runner.stop_signal)  # type: ignore[arg-type]  # no job starts now
        if sweep_jobs.in_launching_process():  # (in a worker: the launcher's process stops the sweep)
            raise SweepInterrupted(runner.stop_signal, job.sweep_dir.resolve())  # type: ignore[union-attr]  # main reports it
    elif job.requeue and not multirun:  # stopped ahead of its time limit
        log.info(
            "Stopped before the job's time limit; continue with: %s", cli.continue_command(sys.argv[1:], job.work_dir)
        )
        sys.exit(EXIT_REQUEUED)
    value = None if best is None else float(best["value"])
    if multirun and (value is None or not math.isfinite(value)):
        return worst_value(rule)  # diverged or never validated: the worst, never NaN
    return value


def _stops_only_this_job(runner: Any) -> bool:
    """Whether a signal that stopped a sweep's job concerns that job alone, and so stops no other
    job of the sweep: a requeue signal (the job comes back), or SIGTERM to a job that submitit
    runs as a job of its own (Slurm's scancel, preemption or requeue of that one job). SIGINT,
    or SIGTERM to the process that runs the sweep, stops the whole launch."""
    return runner.requeue or (runner.stop_signal == signal.SIGTERM and "SUBMITIT_EXECUTOR" in os.environ)


def _slurm_restarts_it(runner: Any, result: dict[str, Any], multirun: bool) -> bool:
    """Whether the SIGTERM that stopped a Slurm job (submitit's, or an sbatch script's) is Slurm
    ending this attempt to start the job again (``scontrol requeue``, a preemption, which this
    call requeues), not ``scancel``: both send SIGTERM, only Slurm's restart count and the job's
    preemption time tell them apart. Asked once, here, by rank 0 for every rank of the job
    (``distributed.asked_once``): so every rank of a Slurm job calls this, whatever stopped it."""
    from expkit.core import distributed, slurm

    if slurm.job_id() is None:
        return False
    asks = (
        runner.stopped_by_signal
        and result["status"] == "stopped"
        and runner.stop_signal == signal.SIGTERM
        and (not multirun or _stops_only_this_job(runner))
    )
    return bool(distributed.asked_once(lambda main: asks and slurm.being_requeued(distributed.requeue_count(), main)))


def _done_metrics(result: dict[str, Any]) -> str:
    """The Done line's metrics, each with where it comes from: validation at the last epoch, the
    test with the weights it used (the best checkpoint, by default: another epoch's)."""
    final = result["final_metrics"]
    shown = lambda keys: ", ".join(f"{k} {final[k]:.4f}" for k in keys)
    val = [k for k in final if not k.startswith("test/")]
    test = [k for k in final if k.startswith("test/")]
    parts = [f"{shown(val)} (epoch {result.get('epoch')})"] if val else []
    if test:
        weights = result.get("test_checkpoint")
        parts.append(f"{shown(test)}" + (f" (weights {Path(weights).name})" if weights else ""))
    return "; ".join(parts)


def _defer_hydra_record(argv: list[str]) -> bool:
    """A resume (resume=true or a path) must not rewrite the run's .hydra/ before its checkpoint
    is known to fit: Hydra is told not to write it (hydra.output_subdir=null), and the task
    writes the same three files once the checkpoint is checked (``_write_hydra_record``), on rank 0
    (the one that writes .hydra/). Returns whether it was deferred."""
    from expkit.core import distributed

    if distributed.rank() != 0:
        return False
    resume = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=")), "false")
    if (
        resume.strip().lower() in ("false", "null", "none", "0", "")
        or cli.sweeping(argv)
        or any(a.startswith("hydra.output_subdir=") for a in argv)
    ):
        return False
    sys.argv.append("hydra.output_subdir=null")
    return True


def _show_hooks_scratch(argv: list[str]) -> str | None:
    """show_hooks=true prints the table and trains nothing: without a hydra.run.dir of the
    user's, its work dir is a scratch dir, removed afterwards (no empty run dir left behind).
    Hydra reads True and TRUE as true too; any other value than true or false exits 2."""
    if cli.sweeping(argv):
        return None  # (Hydra reads a sweep's values: show_hooks=true,false)
    typed = cli.show_hooks_value(argv)
    if typed is not None and typed.lower() not in ("true", "false", "null"):
        print(f"Error: show_hooks must be true or false, got {typed!r}", file=sys.stderr)
        sys.exit(2)
    if str(typed).lower() != "true" or any(a.startswith(("hydra.run.dir=", "hydra.output_subdir=")) for a in argv):
        return None
    import tempfile

    scratch = tempfile.mkdtemp(prefix="expkit-show-hooks-")
    sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null"]
    return scratch


def _report_interruption(signum: int, sweeping: bool, sweep_dir: Path | None = None) -> None:
    """One short block after a signal stopped the command: for a sweep, its jobs completed,
    interrupted and not started, and the command that resumes it; no traceback."""
    name = signal.Signals(signum).name
    if not sweeping:
        print(f"\nInterrupted ({name}).", file=sys.stderr)
        return
    sweep_dir = sweep_dir or _sweep_dir_of_last_job()
    if sweep_dir is None:
        print(f"\nSweep interrupted ({name}) before its first job started.", file=sys.stderr)
        return
    counts = sweep_jobs.tally_jobs(sweep_dir)
    total = int(os.environ.get(sweep_jobs.SWEEP_JOBS_ENV, "0") or 0)
    started = sum(counts.values())
    parts = [f"{n} {status}" for status, n in counts.items() if n] + (
        [f"{total - started} not started"] if total > started else []
    )
    with contextlib.suppress(Exception):  # the summary as far as it goes (never hides the report)
        from expkit.sweeps.summary import summarize

        summarize(sweep_dir)
    from expkit.sweeps.search import live_workers

    others = live_workers(sweep_dir)  # (this worker of an Optuna search has let go of its lock)
    going_on = (
        f"This worker stopped; {counted(others, 'other worker')} of the search "
        f"{'go' if others > 1 else 'goes'} on and finish{'' if others > 1 else 'es'} its trials.\n"
        if others
        else ""
    )
    print(
        f"\nSweep interrupted ({name}): {', '.join(parts) or 'no job recorded'}"
        f"{f' of {total}' if total else ''}, in {sweep_dir}.\n{going_on}"
        f"Resume it with: {cli.continue_sweep_command(sys.argv[1:], sweep_dir)}",
        file=sys.stderr,
    )


def _sweep_dir_of_last_job() -> Path | None:
    """The sweep dir of the last job Hydra started in this process, if any (a sweeper other than
    expkit's, stopped between its jobs, names none)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().sweep.dir).resolve()


def _write_hydra_record(cfg: DictConfig, work_dir: Path) -> None:
    """.hydra/config.yaml, hydra.yaml and overrides.yaml, as Hydra writes them for a run."""
    from omegaconf import OmegaConf

    hc = HydraConfig.get()
    hydra_node = OmegaConf.to_container(hc, resolve=False)
    hydra_node["output_subdir"] = ".hydra"  # type: ignore[index]
    hydra_node["overrides"]["hydra"] = [o for o in hydra_node["overrides"]["hydra"] if o != "hydra.output_subdir=null"]  # type: ignore[index]
    records = {"config.yaml": cfg, "hydra.yaml": {"hydra": hydra_node}, "overrides.yaml": hc.overrides.task}
    for name, node in records.items():
        atomic.write_text_atomic(work_dir / ".hydra" / name, OmegaConf.to_yaml(node))


def _share_run_dir_across_ranks() -> None:
    """Under torchrun: one run, one work dir. Rank 0 picks the dir (the usual default, or
    hydra.run.dir when given) and every rank uses it; ranks > 0 write no .hydra/ and log to
    rank<N>.log. Without this, each rank's Hydra would make a work dir of its own."""
    from expkit.core import distributed

    if not distributed.init_or_exit():  # (no work dir yet: one line, then the exit)
        return
    if any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        print(
            "Error: a sweep (-m) under torchrun is not supported; start one torchrun per job, or use "
            "hydra/launcher=submitit_slurm with tasks_per_node",
            file=sys.stderr,
        )
        sys.exit(2)
    given = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir=")), None)
    restarts = distributed.restart_count()
    if given is None and restarts > 0:  # the dir the first attempt picked, kept in torchrun's own store
        given = distributed.recall("run_dir")
        if given is None:  # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each attempt has a store of its own)
            print(
                f"Error: torchrun restart {restarts}: the first attempt's work dir is not in torchrun's store; "
                "give it with hydra.run.dir=<dir> so that restarts continue that run",
                file=sys.stderr,
            )
            sys.exit(2)
    default = time.strftime("outputs/runs/%Y-%m-%d_%H-%M-%S-") + f"{time.time_ns() // 1000 % 10**6:06d}"
    run_dir = str(Path(distributed.broadcast_object(given or default)).resolve())
    if distributed.rank() == 0 and restarts == 0:
        distributed.remember("run_dir", run_dir)  # a restart of this torchrun finds the same dir
    sys.argv = [a for a in sys.argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    if restarts > 0:  # torchrun --max-restarts: the group re-formed after a worker died; continue the run
        sys.argv = [a for a in sys.argv if not a.startswith("resume=")] + ["resume=true"]
        if distributed.rank() == 0:
            print(f"torchrun restart {restarts}: resuming {run_dir} from its last complete checkpoint", file=sys.stderr)
    if distributed.rank() > 0:
        sys.argv += ["hydra.output_subdir=null"]  # rank 0 writes .hydra/; run() gives this rank its own log


def _freeze_heap() -> None:
    """Move every object alive now (torch's, Hydra's: modules, functions, classes, which live
    as long as the process) out of the garbage collector's sight. Each full collection
    otherwise walks them all: three of them cost about 0.4 s of a start here, and more
    during training. Objects created later are collected as usual."""
    import gc

    gc.freeze()


def main() -> None:
    """``python -m expkit.train``: check the command line, then run the Hydra app (``run``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 1 for a failed run, and
            128 + the signal number after SIGTERM or SIGINT; nothing when the run completes.
    """
    versions.require()
    take_ctrl_c()  # (a sweep started with `&` in a script inherits SIGINT ignored)
    # --help, --cfg, --info: Hydra prints and exits, and nothing imports torch (1.5 s of a 1.9 s --help)
    prints_only = cli.prints_only(sys.argv[1:])
    if not prints_only and not cli.sweeping(sys.argv[1:]):
        hold_sigterm()  # (under Slurm: a preemption during the start-up stops the run as it begins)
    with quiet_ctrl_c("expkit.train", "while starting; nothing was written", at_once=True):
        if not prints_only:
            importlib.import_module("torch")  # (a run's: imported before the heap is frozen, as it lives as long)
        _freeze_heap()  # torch and Hydra are imported
        sys.argv[1:] = cli.with_run_overrides(cli.search_is_multirun(sys.argv[1:]))  # (flags first, as Hydra parses)
        argv = sys.argv[1:]
        message = cli.check_keys(argv) or cli.check_group_choices(argv) or cli.check_output_dirs(argv)
    if message:
        print(f"Error: {message}", file=sys.stderr)
        sys.exit(2)
    exiting: list[Any] = []  # the code of a SystemExit, kept without the exception: its traceback holds the run
    sweeping = cli.sweeping(argv)
    try:
        if not prints_only:
            _share_run_dir_across_ranks()  # (joins torchrun's process group)
        message = cli.check_owner(sys.argv[1:]) or cli.check_rerun(sys.argv[1:])  # (in use, else already run)
        if message:
            print(f"Error: {message}", file=sys.stderr)
            sys.exit(2)
        deferred = hydra_compat.RECORD_DEFERRED.set(not prints_only and _defer_hydra_record(sys.argv[1:]))
        scratch = _show_hooks_scratch(sys.argv[1:])
        try:
            with raise_on_sigterm() if sweeping else contextlib.nullcontext():
                run()
        finally:
            hydra_compat.RECORD_DEFERRED.reset(deferred)
            if scratch is not None:
                import shutil

                shutil.rmtree(scratch, ignore_errors=True)
    except (KeyboardInterrupt, SweepInterrupted) as exc:  # Ctrl-C, or a signal that stopped a sweep
        for sig in (signal.SIGINT, signal.SIGTERM):  # stopping already: another Ctrl-C changes nothing now
            signal.signal(sig, signal.SIG_IGN)
        signum = exc.signum if isinstance(exc, SweepInterrupted) else signal.SIGINT
        _report_interruption(signum, sweeping, getattr(exc, "sweep_dir", None))
        exiting.append(128 + signum)
    except SystemExit as exc:
        # Hydra's own errors (an unknown key, an unparsable override) are the user's to fix, like
        # expkit's: one exit code for "fix your input"
        exiting.append(exit_status(exc))  # (Hydra's refusal was said in one line: hydra_compat.main)
    finally:
        import gc

        if not prints_only:  # (Hydra only printed: no group was joined)
            from expkit.core import distributed

            distributed.shutdown()  # (the run's objects are garbage by now, on a SystemExit too: collected there)
        gc.unfreeze()  # a process that calls main() again (a test, a driver script) collects this run's objects
        while _SETTLED:  # (a caller of main() in its own process gets its Ctrl-C and SIGTERM back)
            signal.signal(*_SETTLED.pop())
        release_sigterm()  # (a start-up that failed before the run took its SIGTERM: held no longer)
    if exiting:
        sys.exit(exiting[0])


if __name__ == "__main__":
    main()
    for _sig in (signal.SIGINT, signal.SIGTERM):  # the run is complete: what is left is the interpreter's teardown
        signal.signal(_sig, signal.SIG_IGN)
