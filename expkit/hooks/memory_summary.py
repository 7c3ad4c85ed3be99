"""MemorySummaryHook: process and CUDA memory every few iterations; optionally per layer (NORMAL)."""

from __future__ import annotations

import logging
import os
import resource
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.stages import Priority
from expkit.hooks._probes import OutputProbe, leaf_modules
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["MB", "MemorySummaryHook", "memory_now"]


log = logging.getLogger("expkit")
MB = 1024 * 1024


def memory_now(device: torch.device) -> dict[str, float]:
    """RSS now and at peak (MB), and CUDA allocated / reserved / peak allocated (MB).

    Args:
        device: the run's device; the CUDA figures are read only when it is a CUDA device.

    Returns:
        The figures in MB by log key: ``memory/rss_mb`` (Linux only), ``memory/peak_rss_mb`` and, on
        CUDA, ``memory/cuda_allocated_mb``, ``memory/cuda_reserved_mb``, ``memory/cuda_peak_mb``.
    """
    stats: dict[str, float] = {}
    try:
        with open("/proc/self/statm") as f:
            stats["memory/rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB
    except OSError:  # not Linux
        pass
    stats["memory/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    if device.type == "cuda":
        stats["memory/cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / MB
        stats["memory/cuda_reserved_mb"] = torch.cuda.memory_reserved(device) / MB
        stats["memory/cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / MB
    return stats


class MemorySummaryHook(Hook):
    """Every ``interval`` iterations publishes ``memory/rss_mb``, ``memory/peak_rss_mb`` and,
    on CUDA, ``memory/cuda_allocated_mb``, ``memory/cuda_reserved_mb``, ``memory/cuda_peak_mb``
    to the log record. ``by_layer``: on the first iteration, the memory of each leaf module's
    output (VISSL's by-layer tracking), logged as a table and kept in result.json.

    Args:
        interval: the iterations between measurements (the ``interval``-th, 2 * ``interval``-th, ...
            iteration of the run); at least 1.
        by_layer: also measure each leaf module's output memory once, on the first training iteration.
        top: the number of layers, largest first, in the by-layer table and in result.json's
            ``memory_by_layer_mb``.

    Raises:
        ValueError: `interval` is below 1.
    """

    priority = Priority.NORMAL

    def __init__(self, interval: int = 50, by_layer: bool = False, top: int = 20) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval, self.by_layer, self.top = interval, by_layer, top
        self._probe: OutputProbe | None = None
        self.layer_bytes: dict[str, int] = {}

    def before_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any) -> None:
        if self.by_layer and not self.layer_bytes and self._probe is None:
            self._probe = OutputProbe(leaf_modules(runner.model), self._record)

    def _record(self, name: str, output: torch.Tensor) -> None:
        self.layer_bytes[name] = self.layer_bytes.get(name, 0) + output.numel() * output.element_size()

    def after_forward(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
            rows = sorted(self.layer_bytes.items(), key=lambda kv: -kv[1])[: self.top]
            runner.run_info["memory_by_layer_mb"] = {k: round(v / MB, 4) for k, v in rows}
            table = "\n".join(f"    {k:<40} {v / MB:10.3f} MB" for k, v in rows)
            log.info("Activation memory by layer (one batch, largest first):\n%s", table)

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        if self.every_n_train_iters(runner, self.interval):
            runner.extra_scalars.update(memory_now(runner.device))

    def after_run(self, runner: Runner) -> None:
        runner.run_info["memory"] = {k: round(v, 1) for k, v in memory_now(runner.device).items()}
