"""Self-supervised learning on the digits: BYOL with a momentum encoder, judged by a linear probe.

``BYOLDigits`` learns a representation without labels: two augmented views of each image, an
online network (encoder + projector + predictor) trained to predict the target network's
projection of the other view; the target follows the online network through
``MomentumEncoderHook``. ``LinearProbeHook`` measures the representation at the end: a
logistic regression on frozen encoder features of the training images, scored on the
validation images, against the same probe on a randomly initialised encoder.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from expkit.core.errors import ConfigError
from expkit.core.stages import Priority
from expkit.hooks.base import Hook
from expkit.models import submodule

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["BYOLDigits", "LinearProbeHook", "augment", "linear_probe"]


log = logging.getLogger("expkit")


def _mlp(width_in: int, hidden: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, width_out))


def augment(x: torch.Tensor, noise: float = 0.1, drop: float = 0.1) -> torch.Tensor:
    """A random view of images (N, C, H, W): shifted by up to one pixel each way, some pixels
    dropped, Gaussian noise added. Draws from torch's global generator (seeded, checkpointed).

    Args:
        x: the images, shape (N, C, H, W).
        noise: the standard deviation of the Gaussian noise added.
        drop: the probability of setting each pixel to 0.

    Returns:
        The view, of the same shape as `x`.
    """
    n = len(x)
    shifts = torch.randint(-1, 2, (n, 2))
    out = torch.empty_like(x)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            rows = ((shifts[:, 0] == dy) & (shifts[:, 1] == dx)).nonzero().flatten()
            if len(rows):
                out[rows] = torch.roll(x[rows], shifts=(dy, dx), dims=(-2, -1))
    keep = (torch.rand(x.shape, device=x.device) > drop).to(x.dtype)
    return out * keep + noise * torch.randn(x.shape, device=x.device)


class BYOLDigits(nn.Module):
    """``encoder`` (the representation), ``online`` = encoder + projector, ``target`` = a copy of
    ``online`` (no gradients; MomentumEncoderHook moves it), ``predictor`` on top of online.

    Args:
        in_channels: the number of channels of the input images.
        image_size: the height and width of the input images, in pixels.
        width: the hidden width of the encoder, projector and predictor MLPs.
        features: the size of the representation (the encoder's output).
        projection: the size of the projector's and the predictor's outputs.
    """

    def __init__(
        self, in_channels: int, image_size: int, width: int = 256, features: int = 64, projection: int = 32
    ) -> None:
        super().__init__()
        pixels = in_channels * image_size * image_size
        self.encoder = nn.Sequential(nn.Flatten(), _mlp(pixels, width, features))
        self.online = nn.Sequential(self.encoder, _mlp(features, width, projection))
        self.target = copy.deepcopy(self.online)
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.predictor = _mlp(projection, width, projection)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The representation of images x."""
        return self.encoder(x)

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        one, two = augment(x), augment(x)
        p1, p2 = self.predictor(self.online(one)), self.predictor(self.online(two))
        with torch.no_grad():
            z1, z2 = self.target(one), self.target(two)
        # BYOL's symmetric loss: 2 - 2 cos(prediction of one view, target projection of the other)
        return (4 - 2 * F.cosine_similarity(p1, z2).mean() - 2 * F.cosine_similarity(p2, z1).mean()) / 2

    def train_step(self, batch: Any) -> dict[str, Any]:
        """BYOL's loss on two augmented views of the images; the labels are not used.

        Args:
            batch: (images, labels).

        Returns:
            The ``loss``.
        """
        return {"loss": self._loss(batch[0])}  # labels unused: self-supervised

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """BYOL's loss, and the representation of the images with their labels.

        Args:
            batch: (images, labels).

        Returns:
            The ``loss``, the encoder's ``features`` and the labels as ``targets``.
        """
        x, y = batch
        return {"loss": self._loss(x), "features": self.encoder(x), "targets": y}


def _features(encoder: nn.Module, loader: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    with torch.no_grad():
        for x, y in loader:
            xs.append(encoder(x.to(device)).float().cpu())
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def linear_probe(encoder: nn.Module, train: Any, val: Any, device: torch.device, steps: int = 300) -> float:
    """Validation accuracy of a logistic regression on the frozen, standardised features.

    The probe is fitted with L-BFGS and a small L2 penalty, from a fixed initialisation; the
    encoder is put in eval mode for the features and then back in its mode.

    Args:
        encoder: the module whose outputs are the features.
        train: the loader of (images, labels) batches the probe is fitted on.
        val: the loader of (images, labels) batches the probe is scored on.
        device: the device the encoder runs on.
        steps: the most L-BFGS iterations.

    Returns:
        The probe's accuracy on `val`, in [0, 1].
    """
    was_training = encoder.training
    encoder.eval()
    (x_train, y_train), (x_val, y_val) = _features(encoder, train, device), _features(encoder, val, device)
    encoder.train(was_training)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_val = (x_train - mean) / std, (x_val - mean) / std
    classes = int(max(y_train.max(), y_val.max())) + 1
    generator = torch.Generator().manual_seed(0)
    probe = nn.Linear(x_train.shape[1], classes)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=generator) * 0.01)
        probe.bias.zero_()
    optimizer = torch.optim.LBFGS(probe.parameters(), lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(probe(x_train), y_train) + 1e-3 * probe.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float((probe(x_val).argmax(1) == y_val).float().mean())


class LinearProbeHook(Hook):
    """After training: a linear probe on the model's frozen ``encoder`` (a submodule path),
    fitted on the training images and scored on the validation images, and the same probe on
    a randomly initialised copy of the encoder (the baseline). Logged, and written to
    ``result.json`` as ``linear_probe: {acc, random_init_acc}``. A model without that
    submodule is skipped with a warning.

    Args:
        encoder: the dotted path of the encoder submodule in the model.
        steps: the most L-BFGS iterations of each probe.
        seed: the seed of the baseline encoder's random initialisation.
    """

    supports_sharding = (
        False  # trains a probe on a submodule called outside the model's forward; not checked with FSDP2
    )
    priority = Priority.NORMAL

    def __init__(self, encoder: str = "encoder", steps: int = 300, seed: int = 0) -> None:
        self.encoder, self.steps, self.seed = encoder, steps, seed

    def after_train(self, runner: Runner) -> None:
        val = runner.val_loader
        try:
            encoder = submodule(runner.model, self.encoder, "hooks.linear_probe.encoder")
        except ConfigError as exc:
            log.warning("LinearProbeHook skipped: %s", exc)
            return
        if runner.train_loader is None or val is None:
            log.warning("LinearProbeHook skipped: it needs train and val data")
            return
        if isinstance(val, dict):
            val = next(iter(val.values()))
        rng = torch.get_rng_state()
        random_init = copy.deepcopy(encoder)
        torch.manual_seed(self.seed)
        for module in random_init.modules():
            if hasattr(module, "reset_parameters") and module is not random_init:
                module.reset_parameters()
        torch.set_rng_state(rng)  # the baseline's draws leave the run's random stream as it was
        result = {
            "acc": linear_probe(encoder, runner.train_loader, val, runner.device, self.steps),
            "random_init_acc": linear_probe(random_init, runner.train_loader, val, runner.device, self.steps),
        }
        log.info(
            "Linear probe on %s: val accuracy %.4f (a randomly initialised encoder: %.4f)",
            self.encoder,
            result["acc"],
            result["random_init_acc"],
        )
        runner.run_info["linear_probe"] = result
