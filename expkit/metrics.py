"""Evaluation metrics (accumulated on the device, read once per pass) and metric directions."""

from __future__ import annotations

import torch

# MMEngine's defaults: a key containing one of these is better when greater / less
GREATER_KEYS = ("acc", "top", "AR@", "auc", "precision", "mAP", "mDice", "mIoU", "mAcc", "aAcc", "f1", "recall")
LESS_KEYS = ("loss", "error", "err", "perplexity")


def infer_rule(key: str, greater_keys=GREATER_KEYS, less_keys=LESS_KEYS) -> str | None:
    """'greater' or 'less' for a metric name such as 'val/acc'; None when it cannot tell."""
    name = key.rsplit("/", 1)[-1].lower()
    for keys, rule in ((greater_keys, "greater"), (less_keys, "less")):
        if name in (k.lower() for k in keys):
            return rule
    for keys, rule in ((greater_keys, "greater"), (less_keys, "less")):
        if any(k.lower() in name for k in keys):
            return rule
    return None


class Metric:
    """update(logits, targets) per batch; compute() -> float once per pass; reset()."""

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self) -> float:
        raise NotImplementedError

    def sync(self) -> None:
        """Combine the counts of all DDP ranks (before compute); a no-op in one process."""


class Accuracy(Metric):
    """Top-k classification accuracy in [0, 1]."""

    def __init__(self, top_k: int = 1) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.reset()

    def reset(self) -> None:
        self.correct: torch.Tensor | int = 0
        self.total = 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        if self.top_k == 1:
            hits = logits.argmax(dim=-1) == targets
        else:
            hits = (logits.topk(self.top_k, dim=-1).indices == targets.unsqueeze(-1)).any(dim=-1)
        self.correct = self.correct + hits.sum()
        self.total += targets.numel()

    def compute(self) -> float:
        return float(self.correct) / self.total if self.total else float("nan")

    def sync(self) -> None:
        from expkit.distributed import all_reduce_sum, is_distributed, reduce_device

        if is_distributed():
            counts = torch.tensor([float(self.correct), float(self.total)], dtype=torch.float64, device=reduce_device())
            all_reduce_sum(counts)
            self.correct, self.total = counts[0], int(counts[1])
