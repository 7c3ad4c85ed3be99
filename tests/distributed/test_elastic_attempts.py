"""torchrun's attempts in its one store (``distributed.elastic_attempt``): the workers of one attempt
share a key prefix no other attempt has, also when the world size changes between attempts
(``--nnodes=1:2``, a node that leaves or joins). The store is c10d's own (a HashStore); the
workers of each attempt join it one after another, as torchrun's would in any order."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from expkit.core.distributed import elastic_attempt

# (agents, workers) of each attempt: a node joins, one leaves, two of one process each, a worker fails
ROUNDS = [(1, 2), (2, 4), (1, 2), (2, 2), (2, 4), (2, 4), (1, 2)]


def _attempts(monkeypatch, rounds, restarts=None):
    store = dist.HashStore()
    seen = []
    for i, (agents, world) in enumerate(rounds):
        monkeypatch.setenv("GROUP_WORLD_SIZE", str(agents))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts[i] if restarts else 0))
        seen.append([elastic_attempt(store, world) for _ in range(world)])
    return seen


def test_the_workers_of_one_attempt_share_a_prefix_no_other_attempt_has(monkeypatch):
    # membership changes restart the workers without counting a restart: the count stays 0
    seen = _attempts(monkeypatch, ROUNDS)
    prefixes = []
    for i, workers in enumerate(seen):
        assert len(set(workers)) == 1, f"attempt {i} split: {workers}"  # (a split group waits forever)
        prefixes.append(workers[0][0])
    assert len(set(prefixes)) == len(ROUNDS), prefixes  # (a shared prefix reads an earlier group's peers)
    assert [workers[0][1] for workers in seen] == list(range(len(ROUNDS)))  # numbered by the group, in order


@pytest.mark.parametrize("agents", [1, 2])
def test_the_same_world_size_restarted_numbers_its_attempts(monkeypatch, agents):
    seen = _attempts(monkeypatch, [(agents, 2)] * 3, restarts=[0, 1, 2])
    assert [workers[0][1] for workers in seen] == [0, 1, 2]
    assert all(len(set(workers)) == 1 for workers in seen)
    assert len({workers[0][0] for workers in seen}) == 3
