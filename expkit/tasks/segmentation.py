"""Semantic segmentation: synthetic images of simple shapes with per-pixel masks, and a small
fully-convolutional encoder-decoder.

Use with ``loss: torch.nn.CrossEntropyLoss`` ((N, C, H, W) logits against (N, H, W) masks)
and e.g. ``torchmetrics.classification.MulticlassJaccardIndex`` (mean IoU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from expkit.core.errors import ConfigError
from expkit.data import DataModule

__all__ = ["CLASS_NAMES", "SegNet", "ShapesData", "make_shapes"]


BACKGROUND, CIRCLE, SQUARE, TRIANGLE = 0, 1, 2, 3
CLASS_NAMES = ("background", "circle", "square", "triangle")


class ShapesData(DataModule):
    """Synthetic grey images of discs, squares and triangles, with per-pixel class masks
    (0 background, 1 circle, 2 square, 3 triangle).

    Each image holds 1 to ``max_shapes`` shapes of random class, size and position; where
    shapes overlap, the one drawn later owns the pixels. Shapes are brighter than the
    background by a random per-image contrast, then Gaussian noise of std ``noise`` is added.
    Images are float32 (1, H, W), masks int64 (H, W). Every split is drawn from its own
    generator seeded by (``split_seed``, split), so the same ``split_seed`` gives the same
    images and the val/test images do not change with ``num_train``.

    Args:
        num_train: the number of training images.
        num_val: the number of validation images.
        num_test: the number of test images (0: no test set).
        image_size: the height and width of the images, in pixels (at least 8).
        max_shapes: the most shapes in one image.
        noise: the standard deviation of the Gaussian noise added to the images.
        split_seed: the seed of the images.
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when a size, `image_size`, `max_shapes` or `noise` is out of range.
    """

    in_channels, num_classes = 1, len(CLASS_NAMES)

    def __init__(
        self,
        num_train: int = 1000,
        num_val: int = 200,
        num_test: int = 200,
        image_size: int = 32,
        max_shapes: int = 3,
        noise: float = 0.1,
        split_seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if num_train < 1 or num_val < 1 or num_test < 0:
            raise ConfigError("data.num_train and data.num_val must be >= 1, data.num_test >= 0")
        if image_size < 8:
            raise ConfigError(f"data.image_size must be >= 8 pixels, got {image_size}")
        if max_shapes < 1:
            raise ConfigError(f"data.max_shapes must be >= 1, got {max_shapes}")
        if noise < 0:
            raise ConfigError(f"data.noise must be >= 0, got {noise}")
        self.sizes = (num_train, num_val, num_test)
        self.image_size = image_size
        self.max_shapes = max_shapes
        self.noise = noise
        self.split_seed = split_seed

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The train, validation and test images with their masks.

        Returns:
            A ``TensorDataset`` of (images, masks) for each split; the test set is None when
                ``num_test`` is 0.
        """
        splits = []
        for i, n in enumerate(self.sizes):
            if n == 0:
                splits.append(None)
                continue
            g = torch.Generator().manual_seed(1_000_003 * self.split_seed + i)  # one stream per split
            images, masks = make_shapes(n, self.image_size, self.max_shapes, self.noise, g)
            splits.append(TensorDataset(images, masks))
        return splits[0], splits[1], splits[2]

    def describe(self) -> dict[str, Any]:
        """What a model needs to know of the data, by constructor-argument name.

        Returns:
            ``in_channels``, ``image_size`` and ``num_classes``.
        """
        return {"in_channels": self.in_channels, "image_size": self.image_size, "num_classes": self.num_classes}


def make_shapes(
    n: int, size: int, max_shapes: int, noise: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 1, size, size) float32 and masks (n, size, size) int64, drawn from
    ``generator``; all images at once, one pass per shape slot.

    Args:
        n: the number of images.
        size: the height and width of each image, in pixels.
        max_shapes: the most shapes in one image (each holds 1 to `max_shapes`).
        noise: the standard deviation of the Gaussian noise added to the images.
        generator: the generator every random draw comes from.

    Returns:
        The images and their masks.
    """
    g = generator
    s = max_shapes
    count = torch.randint(1, s + 1, (n, 1), generator=g)  # shapes in each image
    active = torch.arange(s).unsqueeze(0) < count  # (n, s)
    kind = torch.randint(CIRCLE, TRIANGLE + 1, (n, s), generator=g)
    # half-extent in pixels: 10%..25% of the side, so a shape covers about 1%..20% of the image
    r = size * (0.10 + 0.15 * torch.rand(n, s, generator=g))
    cx = r + torch.rand(n, s, generator=g) * (size - 2 * r)  # fully inside the image
    cy = r + torch.rand(n, s, generator=g) * (size - 2 * r)

    coords = torch.arange(size, dtype=torch.float32) + 0.5  # pixel centres
    dx = coords.view(1, 1, 1, size) - cx[..., None, None]  # (n, s, 1, W)
    dy = coords.view(1, 1, size, 1) - cy[..., None, None]  # (n, s, H, 1)
    rr = r[..., None, None]
    disc = dx.square() + dy.square() <= rr.square()
    square = (dx.abs() <= 0.85 * rr) & (dy.abs() <= 0.85 * rr)  # 0.85: about the disc's area
    # apex up (image rows grow downwards): the half-width grows from 0 at the top to r at the base
    triangle = (dy.abs() <= rr) & (dx.abs() <= (dy + rr) / 2)
    inside = torch.where(
        (kind == CIRCLE)[..., None, None], disc, torch.where((kind == SQUARE)[..., None, None], square, triangle)
    )
    inside &= active[..., None, None]

    masks = torch.zeros(n, size, size, dtype=torch.long)
    for k in range(s):  # later shapes overwrite earlier ones
        masks = torch.where(inside[:, k], kind[:, k, None, None], masks)

    background = 0.2 * torch.rand(n, 1, 1, generator=g)
    contrast = 0.4 + 0.6 * torch.rand(n, 1, 1, generator=g)  # per-image brightness of the shapes
    images = background + contrast * (masks > 0).float()
    images = images + noise * torch.randn(n, size, size, generator=g)
    return images.unsqueeze(1).contiguous(), masks


def _block(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    """Two 3x3 Conv-BN-ReLU layers; the first may downsample by ``stride``."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SegNet(nn.Module):
    """A small U-Net: three resolutions (1, 1/2, 1/4) with ``width``, 2x and 4x channels,
    bilinear upsampling with skip connections, and a 1x1 classifier per pixel.

    forward: (N, in_channels, H, W) -> logits (N, num_classes, H, W); any H, W >= 4.

    Args:
        in_channels: the number of channels of the input images.
        num_classes: the number of classes (output channels).
        width: the channels at full resolution (2x and 4x at the lower ones).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        w = width
        self.enc1 = _block(in_channels, w)
        self.enc2 = _block(w, 2 * w, stride=2)
        self.enc3 = _block(2 * w, 4 * w, stride=2)
        self.dec2 = _block(4 * w + 2 * w, 2 * w)
        self.dec1 = _block(2 * w + w, w)
        self.head = nn.Conv2d(w, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(s1)
        bottom = self.enc3(s2)
        up = F.interpolate(bottom, size=s2.shape[-2:], mode="bilinear", align_corners=False)
        d2 = self.dec2(torch.cat([up, s2], dim=1))
        up = F.interpolate(d2, size=s1.shape[-2:], mode="bilinear", align_corners=False)
        d1 = self.dec1(torch.cat([up, s1], dim=1))
        return self.head(d1)

    def eval_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        """Validation/test step: per-pixel cross-entropy (mean over all pixels), the logits,
        the per-pixel class indices ("preds", which metrics read first) and the masks.

        Args:
            batch: (images, masks).

        Returns:
            The ``loss``, the ``logits``, the ``preds`` and the masks as ``targets``.
        """
        images, masks = batch
        logits = self(images)
        return {"loss": F.cross_entropy(logits, masks), "logits": logits, "preds": logits.argmax(1), "targets": masks}
