"""A restored run's inputs as its model sees them: one example batch and the range of the
training inputs. ``expkit.export`` records both beside an exported model; ``expkit.predict``
checks new inputs against them (or against what an export recorded).

Both commands rebuild the run with ``expkit.config.restore`` and read its loaders here, one
layer below them, so that neither command imports the other.
"""

from __future__ import annotations

from typing import Any

from expkit.core.errors import ConfigError

__all__ = ["example_input", "training_range"]


def example_input(loaders: Any) -> Any:
    """The inputs of one batch of the run's validation data (else test, else train).

    Args:
        loaders: the run's (train, val, test) loaders; of named ones, the first is used.

    Returns:
        The first element of the batch when it is a list or tuple, else the batch itself (a dict
            for a Hugging Face model).

    Raises:
        ConfigError: when the run has none of the three loaders.
    """
    for loader in (loaders[1], loaders[2], loaders[0]):
        if isinstance(loader, dict):  # named sets: the first
            loader = next(iter(loader.values()), None)
        if loader is not None:
            batch = next(iter(loader))
            return batch[0] if isinstance(batch, (list, tuple)) else batch
    raise ConfigError("the run's data has no loader to take an example input from")


def training_range(loaders: Any, batches: int = 20) -> tuple[float, float] | None:
    """The 1st and 99th percentiles of the model's inputs over the first `batches` training
    batches (as the data's transform gives them); None when the inputs are not float tensors.

    Args:
        loaders: the run's (train, val, test) loaders; the train loader (the first of named
            ones) is read.
        batches: the number of training batches to read.

    Returns:
        The 1st and 99th percentiles of a sample of the inputs' values; None when there is no
            training batch or its inputs are not float tensors.
    """
    import torch  # (here: export's and predict's --help need no torch)

    train = loaders[0]
    if isinstance(train, dict):
        train = next(iter(train.values()), None)
    values = []
    for n, batch in enumerate(train or ()):
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        values.append(x.detach().float().flatten()[:: max(1, x.numel() // 4096)])
        if n + 1 >= batches:
            break
    if not values:
        return None
    low, high = torch.quantile(torch.cat(values), torch.tensor([0.01, 0.99])).tolist()
    return low, high
