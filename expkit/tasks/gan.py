"""A small GAN on the digits: a model that owns its update, with two optimizers.

``DigitsGAN.train_step(batch, optimizers)`` takes a discriminator step, then a generator
step (``optim=gan`` defines the two optimizers by name, each over its submodule). Validation
measures how close generated images come to real ones: ``NearestRealDistance``, the mean
distance from each generated image to its nearest real image of the batch (less is better).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expkit.metrics import Metric
from expkit.optimizers import Optimizers

__all__ = ["DigitsGAN", "NearestRealDistance"]


class DigitsGAN(nn.Module):
    """An MLP generator (latent noise -> image in [0, 1]) and an MLP discriminator (image -> logit).

    Args:
        in_channels: the number of channels of the images.
        image_size: the height and width of the images, in pixels.
        latent_dim: the size of the latent noise.
        hidden: the width of the hidden layers of both MLPs.
    """

    def __init__(self, in_channels: int, image_size: int, latent_dim: int = 16, hidden: int = 128) -> None:
        super().__init__()
        pixels = in_channels * image_size * image_size
        self.shape = (in_channels, image_size, image_size)
        self.latent_dim = latent_dim
        self.generator = nn.Sequential(
            nn.Linear(latent_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, pixels),
            nn.Sigmoid(),
        )
        self.discriminator = nn.Sequential(
            nn.Flatten(),
            nn.Linear(pixels, hidden),
            nn.LeakyReLU(0.2),
            nn.Dropout(0.3),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Dropout(0.3),
            nn.Linear(hidden, 1),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images generated from latent codes z (N, latent_dim)."""
        return self.generator(z).view(len(z), *self.shape)

    def sample(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """Images generated from fresh latent noise (drawn from torch's generator).

        Args:
            n: the number of images.
            device: the device of the noise; None: the model's.

        Returns:
            The images, shape (n, in_channels, image_size, image_size).
        """
        return self(torch.randn(n, self.latent_dim, device=device or next(self.parameters()).device))

    def train_step(self, batch: Any, optimizers: Optimizers) -> dict[str, Any]:
        """One discriminator step (real vs generated), then one generator step (fool it).

        Args:
            batch: (images, labels); the labels are not used.
            optimizers: the run's optimizers, ``discriminator`` and ``generator`` among them.

        Returns:
            The summed ``loss`` (for logging), and ``log`` with ``d_loss`` and ``g_loss``.
        """
        real = batch[0]
        ones = torch.ones(len(real), 1, device=real.device)
        fake = self.sample(len(real), real.device)

        optimizers.zero_grad("discriminator")
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(real), 0.9 * ones
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), torch.zeros_like(ones))
        optimizers.backward(d_loss)
        optimizers.step("discriminator")

        optimizers.zero_grad("generator")
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        optimizers.backward(g_loss)
        optimizers.step("generator")  # the discriminator's gradients from this pass are cleared by the loop
        return {"loss": (d_loss + g_loss).detach(), "log": {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}}

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """The generator's loss against the current discriminator, and generated vs real images.

        Args:
            batch: (images, labels); the labels are not used.

        Returns:
            The ``loss``, generated images flattened as ``preds`` and the real ones as ``targets``.
        """
        real = batch[0]
        fake = self.sample(len(real), real.device)
        g_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(fake), torch.ones(len(real), 1, device=real.device)
        )
        return {"loss": g_loss, "preds": fake.flatten(1), "targets": real.flatten(1)}


class NearestRealDistance(Metric):
    """Mean L2 distance from each generated image to the nearest real image of its batch."""

    higher_is_better = False

    def reset(self) -> None:
        self.total: torch.Tensor | float = 0.0
        self.count = 0

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        self.total = self.total + torch.cdist(preds.float(), targets.float()).min(dim=1).values.sum()
        self.count += len(preds)

    def compute(self) -> float:
        """The mean distance since the last reset.

        Returns:
            The mean over the generated images of their distance to the nearest real image; NaN
                before any batch.
        """
        return float(self.total) / self.count if self.count else float("nan")

    def sync(self) -> None:
        total, count = self.sum_over_ranks(self.total, self.count)
        self.total, self.count = total, int(count)
