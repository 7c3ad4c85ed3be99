"""``python -m expkit.check``: the command. It checks the command line, plans the runs, trains
them in a scratch dir, compares them, prints the report and writes ``check.out``; exit 0 when
all match, 1 on any divergence or a run that fails, 2 on bad input."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig

from expkit.check.comparison import compare
from expkit.check.planning import Plan, plan, validate_settings
from expkit.check.report import Comparison, json_report, render, summary
from expkit.check.training_runs import Run, RunFailed, failed_runs, last_error, split_argv, train_all
from expkit.config import cli
from expkit.core import hydra_compat, versions
from expkit.core.errors import TaskExit, config_errors_exit_2, exit_status

__all__ = ["main", "run"]

log = logging.getLogger("expkit")


# (conf/ is expkit's, one level up; check.yaml names the job `check`, as this command's module
# was named before it became a package)
@hydra_compat.main(config_path="../conf", config_name="check")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: bad input exits 2, a run that fails later 1, each with one line.

    Args:
        cfg: the composed ``check.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input, 1 when a run fails or the runs differ; nothing
            when everything matches.
    """
    try:
        with config_errors_exit_2():
            _check(cfg)
    except RunFailed as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(1) from None


def _check(cfg: DictConfig) -> None:
    validate_settings(cfg.check)
    argv, _ = split_argv(sys.argv[1:])
    the_plan = plan(cfg, _processes())
    given_dir = cfg.check.get("dir")
    if given_dir is not None:
        Path(given_dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="expkit-check-", dir=given_dir))
    the_plan.scratch = scratch.resolve()
    log.info(
        "Checking %s iterations a run (%d a epoch), interrupted after iteration %d; scratch dir %s",
        the_plan.budget,
        the_plan.steps_per_epoch,
        the_plan.kill_at,
        scratch,
    )
    started = time.perf_counter()
    runs = {name: Run(name, scratch / name) for name in "abc"}
    try:
        result = _train_and_compare(runs, argv, the_plan)
    finally:
        if not cfg.check.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    kept_in = scratch if cfg.check.keep else None
    print(render(result.rows, result.findings))
    print(summary(result.ok, the_plan, seconds, runs, kept_in))
    out = cfg.check.get("out")
    if out:
        from expkit.core import atomic

        report = json_report(result, the_plan, seconds, runs, kept_in)
        atomic.write_text_atomic(Path(out), json.dumps(report, indent=2) + "\n")
        print(f"Report: {out}")
    if not result.ok:
        sys.exit(1)


def _train_and_compare(runs: dict[str, Run], argv: list[str], the_plan: Plan) -> Comparison:
    """Train the runs, then compare them; a run that failed (not killed on purpose) stops it."""
    train_all(runs, argv, the_plan)
    failed = failed_runs(runs)
    if failed:
        raise RunFailed(f"run {failed[0].name} failed: {last_error(failed[0])}")
    outputs = "".join(r.output for r in runs.values())
    return compare(runs["a"], runs["b"], runs["c"], the_plan, outputs)


def _processes() -> int:
    """Processes per run: ``torchrun --nproc_per_node=N -m expkit.check`` starts its runs with N."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _under_torchrun() -> None:
    """torchrun --nproc_per_node=N -m expkit.check: rank 0 runs the check, starting each run with
    torchrun on N processes; the other ranks have nothing to do and end at once."""
    world = _processes()
    if world <= 1:
        return
    if int(os.environ.get("LOCAL_WORLD_SIZE", world) or world) != world:
        print(
            f"Error: the check runs on one machine (torchrun --nnodes=1); this torchrun spans "
            f"{world // int(os.environ['LOCAL_WORLD_SIZE'])} nodes",
            file=sys.stderr,
        )
        sys.exit(2)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        sys.exit(0)


def _refused_message(argv: list[str]) -> str | None:
    """Why the command line is refused before Hydra composes anything; None when it is not."""
    refused = split_argv(argv)[1]
    if refused:
        return (
            f"{refused[0]}: the check runs one experiment, from scratch, in a scratch dir of its own; leave out "
            "-m, resume= and hydra.sweep.* (pass the overrides you train with)"
        )
    return cli.check_keys(argv) or cli.check_group_choices([a for a in argv if not a.lstrip("+~").startswith("check.")])


def main() -> None:
    """``python -m expkit.check``: check the command line, then run the Hydra app (``run``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 1 when a run fails or
            the runs differ, 130 after Ctrl-C; under torchrun, 0 at once on ranks other than 0.
    """
    versions.require()
    _under_torchrun()
    argv = sys.argv[1:]
    message = _refused_message(argv)
    if message:
        print(f"Error: {message}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = cli.flags_first(argv)
    try:
        run()
    except KeyboardInterrupt:
        # Ctrl-C: the runs were stopped (and the scratch dir removed, unless kept)
        print("\nInterrupted: the check stopped its runs; nothing was checked", file=sys.stderr)
        sys.exit(130)
    except SystemExit as exc:
        sys.exit(exit_status(exc))
