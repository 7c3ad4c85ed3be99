"""A custom data module: the digits with Gaussian noise added to the training images."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

from expkit.data import DataModule, load_digits, stratified_split


class NoisyTrain(Dataset):
    """Adds fresh noise each time a training image is read (a simple augmentation)."""

    def __init__(self, base: TensorDataset, noise: float) -> None:
        self.base, self.noise = base, noise

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return (x + self.noise * torch.randn_like(x)).clamp(0, 1), y


class NoisyDigits(DataModule):
    in_channels, image_size, num_classes = 1, 8, 10

    def __init__(self, noise: float = 0.1, val_fraction: float = 0.2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.noise, self.val_fraction = noise, val_fraction

    def datasets(self):
        x, y = load_digits()
        train_idx, val_idx = stratified_split(y, self.val_fraction, seed=0)
        train = NoisyTrain(TensorDataset(x[train_idx], y[train_idx]), self.noise)
        return train, TensorDataset(x[val_idx], y[val_idx]), None
