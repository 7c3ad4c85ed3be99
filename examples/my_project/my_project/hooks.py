"""A custom hook: the L2 norm of the weights after each epoch, logged and kept across resumes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from expkit import Hook, Priority


class WeightNormHook(Hook):
    """After each training epoch, publishes ``train/weight_norm`` (it lands in the next log
    record) and keeps the history, which survives a resume through the checkpoint."""

    priority = Priority.ABOVE_NORMAL  # before the logger (BELOW_NORMAL), so the value is logged

    def __init__(self, warn_above: float = 100.0) -> None:
        self.warn_above = warn_above
        self.history: list[float] = []

    def after_train_epoch(self, runner) -> None:
        with torch.no_grad():
            norm = torch.linalg.vector_norm(torch.stack([p.norm() for p in runner.model.parameters()])).item()
        self.history.append(norm)
        runner.extra_scalars["train/weight_norm"] = norm
        if norm > self.warn_above:
            runner.request_stop(f"weight norm {norm:.1f} exceeds {self.warn_above}")

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = list(state["history"])
