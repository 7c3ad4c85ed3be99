"""ProfilerHook: torch.profiler over a window of training iterations (VERY_LOW).

Writes to ``<work dir>/traces/``:
  ``train/<host>_<pid>.<n>.pt.trace.json``  Chrome-trace JSON: open it in chrome://tracing or
                                            Perfetto, or point TensorBoard's profiler plugin
                                            (``pip install torch-tb-profiler``) at ``traces/``
  ``train_summary.txt``                     the top operators, as a table
and the same under ``val/`` for the first validation with ``profile_val``. While it records,
every stage, hook call and loop phase (data, forward, backward, optimizer) is marked with
``record_function``, so they show in the trace by name (``stage/after_train_iter``,
``EMAHook.after_optimizer_step``, ``phase/forward``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from torch.profiler import ProfilerActivity, profile

    from expkit.engine.runner import Runner

__all__ = ["ProfilerHook"]


log = logging.getLogger("expkit")


class ProfilerHook(Hook):
    """Profiles iterations ``wait + warmup`` to ``wait + warmup + active`` (``repeat`` times;
    0 repeats until training ends).

    ``activities``: ``cpu``, ``cuda``; ``auto`` adds cuda when the run is on a GPU.
    ``record_shapes``, ``profile_memory``, ``with_stack``, ``with_flops``: torch.profiler's.
    ``profile_val``: also profile the first validation pass. ``row_limit``, ``sort_by``:
    the summary table.

    Args:
        wait: the training iterations skipped at the start of each window (counted from the start of
            this run or resume).
        warmup: the iterations traced but discarded after `wait` (they warm the profiler up).
        active: the iterations recorded after `warmup`; at least 1.
        repeat: the number of wait + warmup + active windows; 0: windows follow one another until
            training ends.
        activities: ``auto`` (cpu, plus cuda when the run is on a GPU), ``cpu``, ``cuda``, or a list of
            these.
        record_shapes: torch.profiler's option: record the operators' input shapes.
        profile_memory: torch.profiler's option: record tensor allocations.
        with_stack: torch.profiler's option: record Python stacks (large traces).
        with_flops: torch.profiler's option: estimate the FLOPs of matmul and convolution operators.
        profile_val: also profile one validation pass, to ``traces/val/``: the first one that starts
            after the training windows are over (none with `repeat` 0).
        row_limit: the rows of the top-operator table (``traces/<train|val>_summary.txt``).
        sort_by: the column of ``key_averages()`` that orders that table, e.g. ``self_cuda_time_total``
            on a GPU.

    Raises:
        ValueError: `wait`, `warmup` or `repeat` is negative, `active` is below 1, or `activities`
            names something other than auto, cpu and cuda.
    """

    priority = Priority.VERY_LOW

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        activities: str | list[str] = "auto",
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        profile_val: bool = False,
        row_limit: int = 20,
        sort_by: str = "self_cpu_time_total",
    ) -> None:
        if wait < 0 or warmup < 0 or active < 1 or repeat < 0:
            raise ValueError("wait, warmup and repeat must be >= 0 and active >= 1")
        names = [activities] if isinstance(activities, str) else list(activities)
        unknown = set(names) - {"auto", "cpu", "cuda"}
        if unknown:
            raise ValueError(f"activities must be among auto, cpu, cuda; got {sorted(unknown)}")
        self.window = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat}
        self.activity_names = names
        self.options = {
            "record_shapes": record_shapes,
            "profile_memory": profile_memory,
            "with_stack": with_stack,
            "with_flops": with_flops,
        }
        self.profile_val = profile_val
        self.row_limit = row_limit
        self.sort_by = sort_by
        self._prof: profile | None = None  # torch.profiler is imported when profiling starts
        self._val_done = False
        self.trace_files: list[Path] = []

    def _activities(self, runner: Runner) -> list[ProfilerActivity]:
        from torch.profiler import ProfilerActivity

        names = set(self.activity_names)
        if "auto" in names:
            names = {"cpu"} | ({"cuda"} if runner.device.type == "cuda" else set())
        return [ProfilerActivity.CPU if n == "cpu" else ProfilerActivity.CUDA for n in sorted(names)]

    def _start(self, runner: Runner, part: str, with_schedule: bool) -> profile:
        from torch.profiler import profile, schedule, tensorboard_trace_handler

        if runner.device.type != "cuda" and "cuda" not in self.activity_names:
            # kineto, on a CUDA build of torch with no GPU, prints "ERROR: ... gpuGetDeviceCount failed
            # with code 35" and its USDT start/stop lines to stderr: noise on a CPU run, whose trace is
            # complete. It reads this setting when it first starts (6: nothing; a user's own stays).
            os.environ["KINETO_LOG_LEVEL"] = os.environ.get("KINETO_LOG_LEVEL") or "6"

        out = runner.work_dir / "traces" / part
        trace_handler = tensorboard_trace_handler(str(out))

        def on_trace_ready(prof: profile) -> None:
            trace_handler(prof)
            self.trace_files = sorted(out.glob("*.pt.trace.json"))
            summary = prof.key_averages().table(sort_by=self.sort_by, row_limit=self.row_limit)
            (runner.work_dir / "traces" / f"{part}_summary.txt").write_text(summary)
            log.info("Profiler trace written to %s (open in Perfetto or TensorBoard)", out)

        prof = profile(
            activities=self._activities(runner),
            schedule=schedule(**self.window) if with_schedule else None,
            on_trace_ready=on_trace_ready,
            **self.options,
        )
        prof.start()
        runner.instrument(markers=True)
        return prof

    def _stop(self, runner: Runner) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()  # exports the current window, also when the run ends early
            runner.instrument(markers=False)

    # -- training ----------------------------------------------------------------------------
    def before_train(self, runner: Runner) -> None:
        self._prof = self._start(runner, "train", with_schedule=True)
        w = self.window
        self._last_step = (w["wait"] + w["warmup"] + w["active"]) * w["repeat"] if w["repeat"] else None

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if self._prof is None:
            return
        self._prof.step()
        if self._last_step is not None and self._prof.step_num >= self._last_step:
            self._stop(runner)  # the window is over: stop marking stages

    def after_train(self, runner: Runner) -> None:
        self._stop(runner)

    # -- validation ----------------------------------------------------------------------------
    def before_val_epoch(self, runner: Runner) -> None:
        if self.profile_val and not self._val_done and self._prof is None:
            self._val_prof = self._start(runner, "val", with_schedule=False)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        if getattr(self, "_val_prof", None) is not None:
            prof, self._val_prof = self._val_prof, None
            prof.stop()
            runner.instrument(markers=self._prof is not None)
            self._val_done = True

    # -- always clean up -------------------------------------------------------------------------
    def on_exception(self, runner: Runner, *, exception: BaseException) -> None:
        self._stop(runner)

    def after_run(self, runner: Runner) -> None:
        self._stop(runner)
        if getattr(self, "_val_prof", None) is not None:
            self._val_prof.stop()
            self._val_prof = None

    def state_dict(self) -> dict[str, Any]:
        return {"val_done": self._val_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._val_done = bool(state.get("val_done", False))
