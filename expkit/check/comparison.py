"""Comparing the check's runs, row by row of the report's table: ``a`` with ``b`` (two runs from
one seed), then ``a`` with the resumed ``c``. The rows are in ``same_seed`` and ``resume``; here
is their order, and which finding is left out because an earlier one explains it."""

from __future__ import annotations

from expkit.check import resume, same_seed
from expkit.check.evidence import read_evidence
from expkit.check.planning import Plan
from expkit.check.report import Comparison
from expkit.check.training_runs import Run

__all__ = ["compare"]


def compare(a: Run, b: Run, c: Run, plan: Plan, outputs: str) -> Comparison:
    """Compare the runs: ``a`` with ``b`` (the same seed), then ``a`` with the resumed ``c``.

    Differences in timings, and whatever differs between ``a`` and ``b`` in the hooks' state,
    are left out. When ``a`` and ``b`` already differ, the findings about the resume are
    dropped (they follow from it).

    Args:
        a: the first run from the seed.
        b: the second run from the same seed.
        c: the run killed after a checkpoint and resumed.
        plan: the plan.
        outputs: the runs' output, searched for the ops torch flags as non-deterministic.

    Returns:
        The table's rows and the findings.
    """
    seen = read_evidence({"a": a, "b": b, "c": c}, plan)
    table = Comparison()
    flagged = same_seed.deterministic_algorithms(table, seen, outputs)
    first_batch = same_seed.same_batches(table, seen)
    same_seed.same_losses_and_weights(table, seen, first_batch, flagged)
    same_seed.same_final_state(table, seen)
    same_seed.same_metrics_jsonl(table, seen)
    same_seed.left_out(table, seen)
    if not plan.checkpoints:
        resume.nothing_to_resume(table)
        return table
    if not resume.interrupted_after_a_checkpoint(table, seen):
        return table
    # what differs after a resume follows from what already differs between two runs from one
    # seed: the resume's rows still say what differs, but only the same-seed findings explain it
    # (an op torch flags is explained above; it need not have made these two runs differ)
    determinism_held = not table.differs("same seed")
    first_batch = resume.same_batches(table, seen, explain=determinism_held)
    weights_held = resume.same_losses_and_weights(table, seen, first_batch, explain=determinism_held)
    for part in resume.FINAL_PARTS:
        if part in seen.checkpoints["a"]:
            resume.final_part(table, seen, part, batches_held=first_batch is None, weights_held=weights_held)
    resume.same_hooks_state(table, seen, weights_held)
    resume.same_eval_metrics(table, seen, weights_held)
    records_differ = resume.same_metrics_jsonl(table, seen)
    result_differs = resume.same_result_json(table, seen)
    dashboards_differ = resume.same_dashboards(table, seen)
    resume.records_finding(table, records_differ or dashboards_differ, result_differs)
    if not determinism_held:
        table.findings = [f for f in table.findings if not f.check.startswith(("resume", "interrupted"))]
    return table
