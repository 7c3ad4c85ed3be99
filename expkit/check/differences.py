"""Where two runs' values differ: nested values compared path by path (tensors bit for bit), and
what any two runs differ in, a clock reading or a duration, left out."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["TIMING", "count_tensors", "diff", "is_timing", "timing_differences", "without"]

# keys of records, checkpoints and hooks that hold a clock reading or a duration: any two runs
# differ in them (found again at every check: a key that also differs between the two
# uninterrupted runs is left out, whatever its name)
TIMING = re.compile(
    r"(^|[/_.])(time|times|data_time|eta|elapsed|since|start|started|wall|wall_time_s|spent_s|"
    r"speed|throughput|seconds|secs|duration|timestamp|last_flush|smoothed)([/_.]|$)",
    re.IGNORECASE,
)


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """The paths (``optimizer.state.3.exp_avg``) where two nested values differ; tensors exactly
    (bit for bit, NaN equal to NaN).

    Args:
        a: a nested value (mappings, lists, tuples, tensors, arrays, scalars).
        b: the value to compare it with.
        path: the path of `a` and `b` themselves, prefixed to every path returned.

    Returns:
        The dotted paths where the values differ (a key missing on one side included); ``.`` when
            they differ at the top; empty when they are equal.
    """
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return [] if _same_tensor(a, b) else [path or "."]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [path or "."]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        differences = []
        # a's keys in a's order, then those only b has: a missing key is a difference by itself
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                differences.append(sub)
            else:
                differences += diff(a[key], b[key], sub)
        return differences
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [path or "."]
        return [
            p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in diff(x, y, f"{path}.{i}" if path else str(i))
        ]
    # NaN is no equal of itself, but two runs that both computed NaN agree
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [path or "."]


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are tensors of one shape and dtype, bit for bit (NaN where NaN is)."""
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    # torch.equal finds NaN unequal to NaN: compare where the NaNs are, then the rest
    return bool(
        a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


def count_tensors(value: Any) -> int:
    """The tensors in a nested value (mappings, lists, tuples).

    Args:
        value: the value, e.g. a checkpoint's optimizer state.

    Returns:
        How many tensors it holds.
    """
    import torch

    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, Mapping):
        return sum(count_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(count_tensors(v) for v in value)
    return 0


def is_timing(path: str) -> bool:
    """Whether a path names a clock reading or a duration (``TIMING``).

    Args:
        path: a path ``diff`` returned.

    Returns:
        True for a timing.
    """
    return bool(TIMING.search(path))


def timing_differences(a: Any, b: Any) -> set[str]:
    """The timings two runs from the same seed differ in: left out of every comparison.

    Args:
        a: a value of the first run (its checkpoint part, records, result.json).
        b: the same value of the second run.

    Returns:
        The paths where they differ that are timings.
    """
    return {p for p in diff(a, b) if is_timing(p)}


def without(paths: list[str], left_out: set[str]) -> list[str]:
    """`paths` less those left out and every timing.

    Args:
        paths: the paths where two values differ.
        left_out: the paths that differ between the same-seed runs anyway.

    Returns:
        The paths that count, in order.
    """
    return [p for p in paths if p not in left_out and not is_timing(p)]
