"""The samplers behind exact resume: orders that are a function of (seed, epoch) and can
skip ahead by index, and their DDP shares.

A resumed run draws the same permutation as an uninterrupted one and skips the batches it
already trained on without loading them; under DDP each rank takes a disjoint share.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

__all__ = ["SeededRandomSampler", "ShardSampler", "seed_worker"]


def seed_worker(worker_id: int) -> None:
    """Seed Python and NumPy in a DataLoader worker from torch's per-worker seed (which the
    loader's seeded generator fixes), so random augmentations repeat run to run.

    Args:
        worker_id: the worker's index, as the DataLoader passes it; not used (torch's per-worker
            seed already differs between workers).
    """
    import random

    import numpy as np

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


class SeededRandomSampler(Sampler[int]):
    """A shuffling sampler whose order is a function of (seed, epoch); can skip ahead by index.

    With ``num_replicas`` > 1 (DDP) every rank draws the same permutation, padded to a
    multiple of the replicas, and takes every ``num_replicas``-th index from ``rank``: the
    ranks see disjoint shares of the data each epoch, and together they go through the
    permutation in order, ``num_replicas`` samples at a time.

    A resume skips the samples the ranks went through, counted over all ranks
    (``skip_samples``): it may come with another number of processes, which then share the
    rest of the permutation (padded again to equal shares, so every rank runs as many batches).

    Args:
        data_source: the dataset; only its length is used.
        seed: the seed of every epoch's permutation (with the epoch).
        rank: this process's rank among the `num_replicas`.
        num_replicas: the number of processes sharing the data (1: no sharing).
    """

    def __init__(self, data_source: Sized, seed: int = 0, rank: int = 0, num_replicas: int = 1) -> None:
        self.n = len(data_source)
        self.seed = seed
        self.rank, self.num_replicas = rank, num_replicas
        self.per_rank = -(-self.n // num_replicas)
        self.epoch = 0
        self._skip = 0  # samples of this epoch's order already trained on, by all ranks together

    def set_epoch(self, epoch: int) -> None:
        """Use the order of `epoch` from the next pass on.

        Args:
            epoch: the epoch number, which selects the permutation together with the seed.
        """
        self.epoch = epoch

    def skip_batches(self, batches: int, batch_size: int) -> None:
        """The next pass starts after `batches` batches of every rank, without loading them.

        Args:
            batches: the number of batches each rank already went through this epoch.
            batch_size: the batch size of each rank.
        """
        self._skip = batches * batch_size * self.num_replicas

    def skip_samples(self, samples: int) -> None:
        """The next pass starts after the first `samples` samples of the epoch's order (all
        ranks together; they may have been more or fewer processes than now).

        Args:
            samples: the number of samples of this epoch's order already gone through, over all ranks.
        """
        self._skip = samples

    def _rest(self) -> int:
        """How many indices this pass takes over all ranks: the rest of the order after the
        skip, padded with the order's first indices to a multiple of the ranks."""
        rest = self.n - min(self._skip, self.n)
        return rest + (-rest) % self.num_replicas

    def permutation(self) -> list[int]:
        """This epoch's order of the whole dataset, before the skip and the split between ranks: a
        function of (seed, epoch) only, never of the number of processes.

        Returns:
            A permutation of ``range(n)``; here a uniform one.
        """
        g = torch.Generator()
        g.manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()
        skip = min(self._skip, self.n)
        # padded with the order's first indices: equal shares; a skip by the same number of processes
        # leaves exactly the rest of the uninterrupted pass (the same padding)
        order = order[skip:] + order[: (skip - self.n) % self.num_replicas]
        if self.num_replicas > 1:
            order = order[self.rank :: self.num_replicas]
        self._skip = 0
        return iter(order)

    def __len__(self) -> int:
        return self._rest() // self.num_replicas


class ShardSampler(Sampler[int]):
    """In order, every ``num_replicas``-th index from ``rank``, no padding: each sample is
    evaluated exactly once over all ranks (validation and test under DDP).

    Args:
        data_source: the dataset; only its length is used.
        rank: this process's rank among the `num_replicas`.
        num_replicas: the number of processes sharing the data.
    """

    def __init__(self, data_source: Sized, rank: int, num_replicas: int) -> None:
        self.indices = list(range(rank, len(data_source), num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
