"""PerfStatsHook: where the time goes, per hook per stage and per loop phase (HIGHEST)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["PerfStatsHook"]


log = logging.getLogger("expkit")


class PerfStatsHook(Hook):
    """Times every hook call at every stage and the loop phases (data loading, forward,
    backward, optimizer step). At the end: a table in the log and ``perf_stats`` in
    result.json, slowest first. Costs two clock reads per hook call and phase.

    Args:
        top: the number of (hook, stage) rows, slowest first, in the log's table; result.json keeps
            every row.
    """

    priority = Priority.HIGHEST

    def __init__(self, top: int = 30) -> None:
        self.top = top
        self.report: dict[str, Any] = {}

    def before_run(self, runner: Runner) -> None:
        runner.instrument(timing=True)
        self._start = time.perf_counter()

    def after_run(self, runner: Runner) -> None:
        if not runner.instrumented and not runner.hook_times and not runner.phase_times:
            return  # already reported (after_run twice is harmless)
        total = time.perf_counter() - self._start
        phases = {k: {"seconds": round(s, 6), "calls": int(n)} for k, (s, n) in runner.phase_times.items()}
        hooks = sorted(runner.hook_times.items(), key=lambda kv: -kv[1][0])
        self.report = {
            "total_s": round(total, 6),
            "phases": phases,
            "hooks": [
                {
                    "hook": name,
                    "stage": stage,
                    "seconds": round(s, 6),
                    "calls": int(n),
                    "mean_us": round(1e6 * s / n, 2),
                }
                for (stage, name), (s, n) in hooks
            ],
        }
        runner.run_info["perf_stats"] = self.report
        lines = [f"Where the time went ({total:.2f} s in the run):"]
        lines += [f"    phase {k:<28} {v['seconds']:9.3f} s  {v['calls']:7d} calls" for k, v in phases.items()]
        lines += [
            f"    {h['hook'] + '.' + h['stage']:<34} {h['seconds']:9.3f} s  {h['calls']:7d} calls  {h['mean_us']:9.1f} us"
            for h in self.report["hooks"][: self.top]
        ]
        log.info("\n".join(lines))
        runner.instrument(timing=False)
        runner.hook_times.clear()
        runner.phase_times.clear()
