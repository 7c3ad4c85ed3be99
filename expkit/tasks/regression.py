"""Tabular regression: scikit-learn's diabetes data and an MLP regressor.

Use with ``criterion: torch.nn.MSELoss`` and regression metrics such as
``torchmetrics.MeanSquaredError`` / ``torchmetrics.R2Score``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from expkit.core.errors import ConfigError
from expkit.data import DataModule, check_fractions, preprocess
from expkit.models import mlp_layers

__all__ = ["DiabetesData", "RegressionMLP", "load_diabetes"]


class DiabetesData(DataModule):
    """scikit-learn's diabetes data (442 patients, 10 features, disease progression after one
    year), split at random into train/val/test by ``split_seed``.

    Features and target are standardised with the *training* split's mean and std, so an
    MSE of 1.0 is the target's (training) variance: predicting the mean scores about 1, and
    ``1 - mse`` is roughly R^2. ``target_mean`` / ``target_std`` (set by ``datasets()``)
    convert predictions back to the original units.

    Args:
        val_fraction: the share of the patients held out for validation (at least one patient).
        test_fraction: the share held out for test (0: no test set).
        split_seed: the seed of the random split.
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when the fractions are out of range.
    """

    num_features, num_outputs = 10, 1

    def __init__(self, val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        check_fractions(val_fraction, test_fraction)
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.target_mean, self.target_std = 0.0, 1.0

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The standardised train, validation and test splits; sets the training statistics.

        Returns:
            The train and validation sets, and the test set (None when ``test_fraction`` is 0).
        """
        x, y = load_diabetes()
        n = len(y)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.split_seed))
        n_val = max(1, round(self.val_fraction * n))
        n_test = round(self.test_fraction * n)
        train_idx = order[: n - n_val - n_test]
        val_idx = order[n - n_val - n_test : n - n_test]
        test_idx = order[n - n_test :]
        # statistics of the training split only: nothing of val/test leaks into the inputs
        x_mean, x_std = x[train_idx].mean(0), x[train_idx].std(0).clamp_min(1e-8)
        y_mean, y_std = y[train_idx].mean(), y[train_idx].std().clamp_min(1e-8)
        x = (x - x_mean) / x_std
        y = (y - y_mean) / y_std
        self.num_features = x.shape[1]
        self.target_mean, self.target_std = float(y_mean), float(y_std)
        self.feature_mean, self.feature_std = x_mean, x_std
        test = TensorDataset(x[test_idx], y[test_idx]) if n_test > 0 else None
        return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx]), test

    def predict_input(self, raw: torch.Tensor) -> torch.Tensor:
        """Rows of the 10 raw features (age, sex, bmi, bp, s1-s6, as scikit-learn's
        ``scaled=False``), standardised with the training split's statistics.

        Args:
            raw: the feature rows, shape (N, 10).

        Returns:
            The standardised features.
        """
        return preprocess(raw, self.preprocessing())

    def preprocessing(self) -> dict[str, Any]:
        """The standardisation of the features, as numbers: the training split's statistics.

        Returns:
            ``raw``, ``mean`` and ``std`` (one per feature), ``formula``.
        """
        if not hasattr(self, "feature_mean"):
            self.datasets()
        return {
            "raw": "rows of the 10 raw features (age, sex, bmi, bp, s1-s6, as scikit-learn's scaled=False)",
            "mean": self.feature_mean.tolist(),
            "std": self.feature_std.tolist(),
            "formula": "(raw - mean) / std",
        }

    def postprocessing(self) -> dict[str, Any]:
        """The target's standardisation undone, as numbers: the training split's statistics
        (``predict_output`` gives disease progression in its own units).

        Returns:
            ``mean``, ``std`` and ``formula``.
        """
        if not hasattr(self, "feature_mean"):
            self.datasets()
        return {"mean": self.target_mean, "std": self.target_std, "formula": "output * std + mean"}

    def describe(self) -> dict[str, Any]:
        """What a model needs to know of the data, by constructor-argument name.

        Returns:
            ``num_features`` and ``num_outputs``.
        """
        return {"num_features": self.num_features, "num_outputs": self.num_outputs}


def load_diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    """The raw diabetes data as (442, 10) float32 features and (442,) float32 targets.

    Reads the gzipped tables that ship inside scikit-learn without importing scikit-learn
    (which costs about 2 s at start-up); falls back to ``sklearn.datasets.load_diabetes``.

    Returns:
        The features and the targets, unscaled.

    Raises:
        ConfigError: when scikit-learn is not installed.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ConfigError("data=diabetes needs scikit-learn, which ships the diabetes data: pip install scikit-learn")
    folder = Path(next(iter(spec.submodule_search_locations or [""]))) / "datasets" / "data"
    data, target = folder / "diabetes_data_raw.csv.gz", folder / "diabetes_target.csv.gz"
    if data.is_file() and target.is_file():
        features = np.loadtxt(data, dtype=np.float32)  # whitespace-separated, no header
        values = np.loadtxt(target, dtype=np.float32)
    else:  # a scikit-learn that stores it elsewhere
        from sklearn.datasets import load_diabetes as sklearn_diabetes

        bunch = sklearn_diabetes(scaled=False)
        features, values = bunch.data.astype(np.float32), bunch.target.astype(np.float32)
    return torch.from_numpy(features), torch.from_numpy(values).reshape(-1)


class RegressionMLP(nn.Module):
    """Linear-ReLU layers of the given widths, then a linear output layer.

    Returns shape (N,) for one output (what ``MSELoss`` and ``R2Score`` expect against (N,)
    targets), else (N, num_outputs).

    Args:
        num_features: the number of input features.
        num_outputs: the number of values predicted per input.
        hidden: the width of each hidden layer, in order.
        dropout: the dropout probability after each hidden layer's ReLU; 0 adds no Dropout layers.

    Raises:
        ValueError: when a hidden width is not a positive integer or `num_outputs` is less than 1.
    """

    def __init__(
        self, num_features: int, num_outputs: int = 1, hidden: Sequence[int] = (64, 64), dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(*mlp_layers(num_features, hidden, num_outputs, dropout))
        self.num_outputs = num_outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out.squeeze(-1) if self.num_outputs == 1 else out
