"""The Hydra callback that keeps a sweep's summary up to date while it runs (``hydra.callbacks``;
stored configs name it ``expkit.sweep.SweepSummaryCallback``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from expkit.core.errors import counted
from expkit.loggers.logs import terminal_shows
from expkit.sweeps.summary import ROWS_DIR, UNSORTED, progress_line, record_job_end, summarize
from expkit.sweeps.sweep_jobs import placed_job
from expkit.workdir.records import BEST_FILE, read_best

__all__ = ["SweepSummaryCallback"]

log = logging.getLogger("expkit")


class SweepSummaryCallback(Callback):
    """A Hydra callback (``hydra.callbacks``): records every job as it ends, in constant time
    (``record_job_end``: a crash leaves an up-to-date summary), and writes the whole summary,
    best first, with sweep.svg at the end of the sweep.

    Args:
        plot_each_job: whether each job's end writes the whole summary and sweep.svg again
            (reads every job: time in proportion to the jobs so far) instead of recording the job.
    """

    def __init__(self, plot_each_job: bool = False) -> None:
        self.plot_each_job = plot_each_job

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return
        if self.plot_each_job:  # the whole summary and sweep.svg: reads every job (O(jobs) per job)
            placed_job(Path(hc.runtime.output_dir))  # (read every job's dir: the placement is not needed)
            self._summarize(Path(hc.sweep.dir), plot=True)
            return
        try:
            ran_in = placed_job(Path(hc.runtime.output_dir))  # (a resumed sweep's job may run elsewhere)
            record_job_end(Path(hc.sweep.dir), ran_in)
            line = progress_line(Path(hc.sweep.dir), ran_in.name)
            log.info("%s", line)  # (the job's train.log; the terminal too with sweep_output=full)
            if not terminal_shows(log, logging.INFO):  # (a quiet terminal: a sweep of expkit.train)
                print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)
        except Exception as exc:  # a summary must never fail the sweep
            log.warning("Could not record the job in %s: %s", hc.sweep.dir, exc)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        current = all((sweep_dir / name).is_file() for name in ("summary.csv", BEST_FILE, "sweep.svg"))
        sorted_already = current and not self.plot_each_job and not (sweep_dir / ROWS_DIR / UNSORTED).exists()
        best = read_best(sweep_dir) if sorted_already else None
        if best is None:  # (a best.json torn by a kill is written again too)
            best = self._summarize(sweep_dir, plot=True)
        if best and best.get("pareto_front") is not None:
            members = ", ".join(f"job {m['job']} ({m['values']})" for m in best["pareto_front"]) or "none"
            log.info("Sweep Pareto front of %s: %s", ", ".join(best["objectives"]), members)
        elif best and best.get("group") is not None and best["value"] is not None:
            spread = f" ± {best['std']:.4f}" if best.get("std") is not None else ""
            log.info(
                "Sweep best: %s, mean %s = %.4f%s over %d seeds; its best job %s (%s)",
                best["group"] or "(one group)",
                best["metric"],
                best["value"],
                spread,
                best["n"],
                best["job"],
                best["work_dir"],
            )
        elif best and best["job"] is not None:
            log.info("Sweep best: job %s, %s = %.4f, %s", best["job"], best["metric"], best["value"], best["work_dir"])
        self._record_in_mlflow(config, sweep_dir)
        summary = sweep_dir / "summary.md"
        if summary.is_file():  # (printed: the terminal is quiet in a sweep; summary.csv, best.json beside it)
            print(f"Sweep summary: {_shown(summary)}", flush=True)
        interrupted = (best or {}).get("statuses", {}).get("interrupted", 0)
        if interrupted:  # (scancel of a cluster job: the sweep itself ended normally)
            log.warning(
                "%s stopped by a signal before the end, saved: run the sweep command again with resume=true "
                "to finish %s (the completed jobs are not run again)",
                counted(interrupted, "job"),
                "them" if interrupted > 1 else "it",
            )

    @staticmethod
    def _record_in_mlflow(config: Any, sweep_dir: Path) -> None:
        """With ``logger=[mlflow]``: the sweep's parent run gets its outcome (``record_sweep``)."""
        settings = (config.get("logger") or {}).get("mlflow")
        if not settings or not sweep_dir.is_dir():
            return
        try:
            from hydra.utils import instantiate

            instantiate(settings).record_sweep(sweep_dir)
        except Exception as exc:  # (a logging backend never fails the sweep)
            log.warning("Could not record the sweep in MLflow: %s", exc)

    def _summarize(self, sweep_dir: Path, plot: bool) -> dict[str, Any] | None:
        try:
            return summarize(sweep_dir, plot=plot)
        except Exception as exc:  # a summary must never fail the sweep
            log.warning("Could not summarize the sweep in %s: %s", sweep_dir, exc)
            return None


def _shown(path: Path) -> str:
    """`path` relative to the current directory when it lies under it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (OSError, ValueError):
        return str(path.resolve())
