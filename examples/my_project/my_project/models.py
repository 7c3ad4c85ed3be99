"""A custom model with its own training step (label smoothing)."""

from __future__ import annotations

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """Flatten, a stem, ``blocks`` residual Linear-ReLU blocks, a classifier. expkit passes
    in_channels, image_size and num_classes from the data module."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        width: int = 128,
        blocks: int = 2,
        label_smoothing: float = 0.1,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks))
        self.head = nn.Linear(width, num_classes)
        self.label_smoothing = label_smoothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def train_step(self, batch):
        """Used by expkit instead of its default forward + criterion."""
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        return {"loss": loss, "logits": logits}
