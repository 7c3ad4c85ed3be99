"""Which GPU a rank of a group uses (``distributed.cuda_index``): the placement a multi-node job
gets from its launcher. No GPU here, so the counts a process would see are given."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("local_rank", "visible", "expected"),
    [(3, 8, 3), (3, 1, 0), (0, 1, 0), (5, 2, "local rank 5 sees 2 GPUs")],
    ids=["every-gpu", "one-gpu-per-task", "rank-0", "too-few"],
)
def test_a_rank_uses_its_local_rank_or_the_one_gpu_it_sees(monkeypatch, local_rank, visible, expected):
    """With Slurm's --gpus-per-task=1 each task sees one GPU, its device 0: LOCAL_RANK as the index
    was "invalid device ordinal" on every local rank above 0. (No GPU here: the count is given.)"""
    import torch

    from expkit.core import distributed
    from expkit.core.errors import ConfigError

    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if isinstance(expected, int):
        assert distributed.cuda_index() == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            distributed.cuda_index()
