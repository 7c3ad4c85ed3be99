"""Seeding, random-generator states (saved in checkpoints) and deterministic mode."""

from __future__ import annotations

import array
import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["algorithm_settings", "rng_states", "seed_everything", "set_deterministic", "set_rng_states"]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices).

    Args:
        seed: the seed; NumPy gets it modulo 2**32.
    """
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic() -> None:
    """torch's deterministic algorithms and settings (an error names any op without one)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def algorithm_settings(deterministic: bool, cudnn_benchmark: bool) -> Iterator[None]:
    """A run's ``trainer.deterministic`` / ``trainer.cudnn_benchmark`` (fixed input shapes:
    cuDNN times its kernels once, then reuses the fastest), put back as they were afterwards.

    Args:
        deterministic: turn on torch's deterministic algorithms and cuDNN's deterministic mode (and
            turn cuDNN's benchmark off).
        cudnn_benchmark: turn on cuDNN's benchmark mode; ignored when `deterministic` is set.

    Yields:
        None, with the settings in force; the three settings are put back on exit (the
        ``CUBLAS_WORKSPACE_CONFIG`` that deterministic mode sets stays).
    """
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    if deterministic:
        set_deterministic()
    elif cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def rng_states() -> dict[str, Any]:
    """Python, NumPy, torch and CUDA generator states as bytes and plain values (loadable with
    weights_only=True). Bytes, not tensors: each tensor is a record of its own in the
    checkpoint's zip file, about 40 us to write, and 625 Python ints to a tensor take 45 us.

    Returns:
        The states by generator: ``python``, ``numpy``, ``torch`` and, once CUDA is initialised,
        ``cuda`` (a list of tensors, one per device).
    """
    import numpy as np

    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": {"version": version, "internal": array.array("Q", internal).tobytes(), "gauss": gauss},
        "numpy": {
            "keys": keys.astype(np.uint32).tobytes(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if torch.cuda.is_initialized():  # (is_available() asks the driver: 10 us a call)
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Put back what ``rng_states`` saved (checkpoints before 2026-11 hold tensors: also read).

    Args:
        states: what ``rng_states`` returned (bytes, or the tensors of older checkpoints); ``numpy``
            and ``cuda`` are optional, and ``cuda`` is put back only when CUDA is available.
    """
    import numpy as np

    py = states["python"]
    internal = py["internal"]
    internal = array.array("Q", internal).tolist() if isinstance(internal, bytes) else internal.tolist()
    random.setstate((py["version"], tuple(internal), py["gauss"]))
    if "numpy" in states:
        n = states["numpy"]
        keys = n["keys"]
        keys = np.frombuffer(keys, dtype=np.uint32) if isinstance(keys, bytes) else keys.numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached"]))
    state = states["torch"]
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8) if isinstance(state, bytes) else state)
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
