"""The table's rows that compare the two runs from one seed, ``a`` and ``b``: they must match bit
for bit. One function per row; each adds its row, and its findings, to the table."""

from __future__ import annotations

import re

from expkit.check.batches import (
    BatchDifference,
    data_advice,
    data_source,
    first_batch_difference,
    first_differing_iteration,
)
from expkit.check.differences import diff, without
from expkit.check.evidence import Evidence, step_name
from expkit.check.report import Comparison, Row

__all__ = [
    "DETERMINISM_WARNING",
    "deterministic_algorithms",
    "left_out",
    "on_rank",
    "same_batches",
    "same_final_state",
    "same_losses_and_weights",
    "same_metrics_jsonl",
]

# what torch prints (warn_only mode) for an op without a deterministic implementation
DETERMINISM_WARNING = re.compile(r"(\S+) does not have a deterministic implementation")


def on_rank(seen: Evidence, rank: int) -> str:
    """`` on rank N`` for a check of several processes per run, else nothing.

    Args:
        seen: the evidence (its plan's processes per run).
        rank: the rank.

    Returns:
        The words to append to a detail or finding.
    """
    return f" on rank {rank}" if seen.plan.nproc > 1 else ""


def deterministic_algorithms(table: Comparison, seen: Evidence, outputs: str) -> list[str]:
    """Row ``deterministic algorithms``: the ops torch named as non-deterministic in any run's output.

    Args:
        table: the table, added to.
        seen: the evidence.
        outputs: every run's output, joined.

    Returns:
        The ops named, sorted.
    """
    flagged = sorted(set(DETERMINISM_WARNING.findall(outputs)))
    device = seen.results["a"].get("device") or "this device"
    for op in flagged:
        table.explain(
            "deterministic algorithms",
            f"`torch.use_deterministic_algorithms` flagged `{op}` on {device}: its results may differ run to run. "
            "Replace the op (or the module that calls it) with a deterministic one, or accept the difference and "
            "leave trainer.deterministic=false",
        )
    table.rows.append(
        Row(
            "deterministic algorithms",
            "differs" if flagged else "ok",
            ", ".join(flagged) if flagged else "no op without a deterministic implementation ran",
        )
    )
    return flagged


def same_batches(table: Comparison, seen: Evidence) -> BatchDifference | None:
    """Row ``same seed: same batches``, on every rank.

    Args:
        table: the table, added to.
        seen: the evidence.

    Returns:
        The first batch that differs; None when none does.
    """
    plan = seen.plan
    first = first_batch_difference(seen.runs["a"], seen.runs["b"], range(plan.budget), plan.nproc)
    table.add(
        "same seed: same batches",
        [f"first differs at iteration {first.iteration}{on_rank(seen, first.rank)}"] if first else [],
        f"{len(seen.traces['a'].iters)} iterations" + (f", {plan.nproc} ranks" if plan.nproc > 1 else ""),
    )
    if first:
        facts = _loader_facts(seen)
        table.explain(
            "same seed: same batches",
            data_advice(
                first.kind,
                facts,
                first.iteration,
                f"of a second run from the same seed{on_rank(seen, first.rank)}",
                data_source(plan, facts),
            ),
        )
    return first


def _loader_facts(seen: Evidence) -> dict:
    """The train loader's facts, as run ``a``'s probe recorded them at its start."""
    start = seen.traces["a"].start
    return start[0].get("loader", {}) if start else {}


def same_losses_and_weights(
    table: Comparison, seen: Evidence, first_batch: BatchDifference | None, flagged: list[str]
) -> None:
    """Row ``same seed: same losses and weights``.

    Args:
        table: the table, added to.
        seen: the evidence.
        first_batch: the first batch that differs between the runs (``same_batches``).
        flagged: the non-deterministic ops torch named (``deterministic_algorithms``).
    """
    ta, tb = seen.traces["a"], seen.traces["b"]
    i = first_differing_iteration(ta, tb, ("loss", "params"), range(seen.plan.budget))
    table.add("same seed: same losses and weights", [f"first differs at iteration {i}"] if i is not None else [])
    # explained only when the batches still agreed there (other batches explain other losses) and
    # no op was flagged (that finding says why already)
    if i is not None and (first_batch is None or i < first_batch.iteration) and not flagged:
        table.explain(
            "same seed: same losses and weights",
            f"iteration {i} of two runs from the same seed saw the same batches but computed other losses or "
            "weights: the model or the step draws randomness expkit's seed does not fix (an unseeded generator, "
            "the clock), or runs an op whose result varies run to run; trainer.deterministic=true names such ops",
        )


def same_final_state(table: Comparison, seen: Evidence) -> None:
    """Row ``same seed: same final state``: every part of the final checkpoint, less the noise.

    Args:
        table: the table, added to.
        seen: the evidence.
    """
    ckpt_a, ckpt_b = seen.checkpoints["a"], seen.checkpoints["b"]
    problems = [
        f"{part}: {path}"
        for part in ckpt_a
        for path in without(diff(ckpt_a[part], ckpt_b.get(part)), seen.noise.checkpoint[part])
    ]
    table.add("same seed: same final state", problems)


def same_metrics_jsonl(table: Comparison, seen: Evidence) -> None:
    """Row ``same seed: same metrics.jsonl``, step by step, less the timings.

    Args:
        table: the table, added to.
        seen: the evidence.
    """
    records_a, records_b = seen.records["a"], seen.records["b"]
    problems = without(diff(records_a, records_b), seen.noise.records)
    table.add(
        "same seed: same metrics.jsonl",
        [f"differs at {step_name(problems[0])}"] if problems else [],
        f"{len(records_a)} records",
    )


def left_out(table: Comparison, seen: Evidence) -> None:
    """Row ``left out: differ between same-seed runs`` (``info``), when anything was: the hooks'
    checkpointed state and attributes that differ between the two runs from one seed.

    Args:
        table: the table, added to.
        seen: the evidence.
    """
    names = set(seen.noise.checkpoint.get("hooks", set()))
    # hooks.<name>.attrs.<attribute> -> <name>.<attribute>
    names |= {path.split(".", 1)[1].replace(".attrs.", ".") for path in seen.noise.hook_attributes}
    if names:
        table.rows.append(Row("left out: differ between same-seed runs", "info", ", ".join(sorted(names))))
