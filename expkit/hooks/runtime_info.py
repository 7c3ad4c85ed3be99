"""RuntimeInfoHook: says what is about to run (VERY_HIGH, so it speaks first)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from expkit.core import distributed
from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["RuntimeInfoHook"]


log = logging.getLogger("expkit")


def _size(loader: object) -> str:
    if isinstance(loader, Mapping):  # named sets
        return "(" + ", ".join(f"{name} {_size(one)}" for name, one in loader.items()) + ")"
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return f"{len(dataset)} samples"
    return f"{len(loader)} batches" if hasattr(loader, "__len__") else "(a stream without a length)"


class RuntimeInfoHook(Hook):
    """Logs the work dir, the processes and their nodes (in a process group), device, model size,
    data sizes and budget at before_run, and records them in ``runner.run_info`` (they end up in
    result.json)."""

    priority = Priority.VERY_HIGH

    def before_run(self, runner: Runner) -> None:
        params = sum(p.numel() for p in runner.model.parameters())
        runner.run_info.setdefault("model_params", params)
        runner.run_info.setdefault("device", str(runner.device))
        world = distributed.world_info()
        for key, value in world.items():
            runner.run_info.setdefault(key, value)
        if not log.isEnabledFor(logging.INFO):  # (nothing to format for a silent log)
            return
        s = runner.settings
        budget = f"{s.max_epochs} epochs" if s.by_epoch else f"{s.max_iters} iterations"
        if runner.train_loader is None or runner.optimizer is None:
            budget = "evaluation only"
        log.info("Work dir: %s", runner.work_dir.resolve())
        if world:
            per_node = ", ".join(f"{node}: {n}" for node, n in world["processes_per_node"].items())
            joined = f"; rendezvous {world['rendezvous']}" if "rendezvous" in world else ""
            log.info(
                "World: %d processes on %d nodes (%s)%s", world["world_size"], len(world["nodes"]), per_node, joined
            )
        extras = [name for name, on in (("compiled", s.compile), ("channels_last", s.channels_last)) if on]
        log.info(
            "Model %s: %s parameters | device %s | precision %s | seed %s | %s%s",
            type(runner.model).__name__,
            f"{params:,}",
            runner.device,
            s.precision,
            s.seed,
            budget,
            "".join(f" | {e}" for e in extras),
        )
        loaders = (("train", runner.train_loader), ("val", runner.val_loader), ("test", runner.test_loader))
        log.info("Data: %s", ", ".join(f"{name} {_size(loader)}" for name, loader in loaders if loader is not None))
