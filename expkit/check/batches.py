"""The batches two runs saw: the first that differs, how it differs (order, samples or values),
and what in the data pipeline a finding about it names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from expkit.check.planning import Plan
from expkit.check.traces import Trace, read_trace
from expkit.check.training_runs import Run

__all__ = ["BatchDifference", "data_advice", "data_source", "first_batch_difference", "first_differing_iteration"]


class BatchDifference(NamedTuple):
    """The first batch that differs between two runs.

    Args:
        iteration: the iteration that saw it.
        rank: the rank that saw it.
        kind: ``order``, ``samples`` or ``values`` (``_sample_kind``).
    """

    iteration: int
    rank: int
    kind: str


def first_differing_iteration(x: Trace, y: Trace, keys: tuple[str, ...], iters: Iterable[int]) -> int | None:
    """The first iteration both traces hold whose records differ in any of `keys`.

    Args:
        x: a run's trace.
        y: the trace of the run it is compared with.
        keys: the iteration record's keys compared (``samples``, ``loss``, ``params``).
        iters: the iterations compared, in order.

    Returns:
        The iteration; None when all of them agree.
    """
    for i in iters:
        if i in x.iters and i in y.iters and any(x.iters[i].get(k) != y.iters[i].get(k) for k in keys):
            return i
    return None


def _sample_kind(x: dict[str, Any], y: dict[str, Any]) -> str:
    """How two batches differ: ``order`` (the same samples, another order), ``samples`` (other
    samples: no tensor's per-sample digests agree) or ``values`` (the same samples by some of
    their tensors, a label for one, other values in others: randomness in the pipeline)."""
    xs, ys = x.get("samples") or [], y.get("samples") or []
    if len(xs) != len(ys):
        return "samples"
    if all(sorted(p) == sorted(q) for p, q in zip(xs, ys, strict=True)):
        return "order"
    if any(p == q for p, q in zip(xs, ys, strict=True)):
        return "values"
    return "samples"


def first_batch_difference(x: Run, y: Run, iters: range, nproc: int) -> BatchDifference | None:
    """The first batch that differs between two runs, on any rank.

    Args:
        x: a run.
        y: the run it is compared with.
        iters: the iterations compared.
        nproc: the processes per run.

    Returns:
        The earliest difference (the lowest rank at a tie); None when every batch agrees.
    """
    found = []
    for rank in range(nproc):
        tx, ty = read_trace(x.work_dir, rank), read_trace(y.work_dir, rank)
        i = first_differing_iteration(tx, ty, ("samples",), iters)
        if i is not None:
            found.append(BatchDifference(i, rank, _sample_kind(tx.iters[i], ty.iters[i])))
    return min(found) if found else None


def data_source(plan: Plan, facts: dict[str, Any]) -> str:
    """What a finding about the data names: ``data=clock_seeded (`checkfix.ClockSeededAugmentation`,
    its train dataset `checkfix._Augmented`)``.

    Args:
        plan: the plan (the ``data=`` option and class).
        facts: the train loader's facts (``check_probe.loader_facts``).

    Returns:
        The option, the class and the dataset, as far as known.
    """
    what = [f"`{plan.data_class}`"] if plan.data_class else []
    if facts.get("dataset"):
        what.append(f"its train dataset `{facts['dataset']}`")
    name = f"data={plan.data_option}" if plan.data_option else "data"
    return f"{name} ({', '.join(what)})" if what else name


def data_advice(kind: str, facts: dict[str, Any], i: int, when: str, source: str) -> str:
    """The finding about a batch that differs: what in the data pipeline makes it, and the fix.

    Args:
        kind: how the batch differs (``BatchDifference.kind``).
        facts: the train loader's facts (``check_probe.loader_facts``).
        i: the iteration that saw it.
        when: the words after ``batch i``: which run saw it.
        source: the data, as ``data_source`` names it.

    Returns:
        The finding's message.
    """
    if kind in ("order", "samples"):
        return _order_advice(kind, facts, i, when)
    # the same samples with other values: randomness the seed does not fix, in the workers, the
    # pipeline (then even two runs from one seed differ) or __getitem__ (then only a resume does)
    if facts.get("num_workers", 0) > 0 and (not facts.get("generator") or not facts.get("worker_init_fn")):
        return (
            f"batch {i} {when} held the same samples with other values: the DataLoader's "
            f"{facts['num_workers']} workers draw their random seeds from the global generator at each epoch's "
            "start (it has no generator=), which a resume mid-epoch does not restore. Build the loader with "
            "generator=torch.Generator().manual_seed(seed) and worker_init_fn=expkit.samplers.seed_worker, "
            "as expkit.data.DataModule.loaders does"
        )
    if not when.startswith("after resume"):
        return (
            f"batch {i} {when} held the same samples with other values: the data pipeline of {source} draws "
            "randomness that expkit's seed does not fix (a generator seeded from the clock, or an unseeded "
            "random.Random(), np.random.default_rng() or torch.Generator()). Seed it from the run's seed "
            "(data.seed), e.g. torch.Generator().manual_seed(seed)"
        )
    return (
        f"batch {i} {when} held the same samples with other values: the dataset's __getitem__ ({source}) "
        "draws from a random generator that expkit neither seeds per sample nor restores on resume (the clock, "
        "an unseeded random.Random()/np.random.default_rng()/torch.Generator(), or the global `random`, "
        "`numpy.random` or torch generator, which skipping batches on resume moves). Draw each sample's "
        "randomness from a generator seeded by (seed, epoch, index)"
    )


def _order_advice(kind: str, facts: dict[str, Any], i: int, when: str) -> str:
    """The finding about a batch of other samples, or the same in another order: the sampler."""
    sampler = facts.get("sampler_name", "?")
    what = "the same samples in another order" if kind == "order" else "other samples"
    if not facts.get("set_epoch") and not facts.get("skips_by_index"):
        return (
            f"batch {i} {when} held {what} than without: the sampler `{sampler}` has no "
            "state_dict()/set_epoch, so its order is drawn anew when a run resumes mid-epoch. Use "
            "expkit.samplers.SeededRandomSampler (expkit.data.DataModule's loaders do), or give the sampler "
            "set_epoch(epoch) and an order that is a function of (seed, epoch) only"
        )
    return (
        f"batch {i} {when} held {what} than without: the sampler `{sampler}`'s order is not a function "
        "of (seed, epoch) only: draw its permutation from torch.Generator().manual_seed(seed + epoch)"
    )
