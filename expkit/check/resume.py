"""The table's rows that compare the uninterrupted run ``a`` with ``c``, killed after a checkpoint
and resumed: they must match from the checkpoint on. One function per row; each adds its row,
and its findings, to the table. A finding says what in the run breaks the resume; where an
earlier difference explains a later one, only the earlier is explained."""

from __future__ import annotations

from collections.abc import Mapping

from expkit.check.batches import (
    BatchDifference,
    data_advice,
    data_source,
    first_batch_difference,
    first_differing_iteration,
)
from expkit.check.differences import count_tensors, diff, without
from expkit.check.evidence import (
    Evidence,
    dashboard_series,
    normalized_result,
    records_by_step,
    step_name,
)
from expkit.check.report import Comparison, Row
from expkit.check.same_seed import on_rank
from expkit.workdir.records import read_records

__all__ = [
    "FINAL_PARTS",
    "final_part",
    "interrupted_after_a_checkpoint",
    "nothing_to_resume",
    "records_finding",
    "same_batches",
    "same_dashboards",
    "same_eval_metrics",
    "same_hooks_state",
    "same_losses_and_weights",
    "same_metrics_jsonl",
    "same_result_json",
]

# the final checkpoint's parts (evidence.checkpoint_parts), a row each: name -> what the row says
FINAL_PARTS = {
    "weights": "weights",
    "optimizer": "optimizer",
    "scheduler": "scheduler",
    "rng": "RNG streams",
    "hooks": "hooks' checkpointed state",
    "position": "position, best metrics",
    "other": "other checkpoint entries",
}


def _and_more(problems: list[str]) -> str:
    return f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""


def nothing_to_resume(table: Comparison) -> None:
    """Row ``resume`` (``skipped``): the run has no checkpoint hook.

    Args:
        table: the table, added to.
    """
    table.rows.append(
        Row("resume", "skipped", "the run has no checkpoint hook (default_hooks.checkpoint): nothing to resume from")
    )


def interrupted_after_a_checkpoint(table: Comparison, seen: Evidence) -> bool:
    """Row ``interrupted after a checkpoint``: run ``c`` killed itself after the checkpoint it
    waited for, and was resumed.

    Args:
        table: the table, added to.
        seen: the evidence.

    Returns:
        Whether it was; nothing after the interruption can be compared when not.
    """
    plan = seen.plan
    if not seen.traces["c"].killed:
        table.rows.append(
            Row(
                "interrupted after a checkpoint",
                "differs",
                f"no checkpoint at iteration {plan.kill_at} appeared: the run was not interrupted",
            )
        )
        table.explain(
            "interrupted after a checkpoint",
            f"the run saved no checkpoint at iteration {plan.kill_at} (default_hooks.checkpoint with by_epoch=false, "
            f"interval={plan.kill_at}): a hook of the run may stop or change checkpointing; pick another point with "
            "check.kill_at=N",
        )
        return False
    steps = plan.steps_per_epoch
    table.rows.append(
        Row(
            "interrupted after a checkpoint",
            "ok",
            f"SIGKILL after iteration {plan.kill_at} (epoch {plan.kill_at // steps + 1}, "
            f"batch {plan.kill_at % steps} of {steps}), resumed",
        )
    )
    return True


def same_batches(table: Comparison, seen: Evidence, explain: bool) -> BatchDifference | None:
    """Row ``resume: same batches``, from the interruption on, on every rank.

    Args:
        table: the table, added to.
        seen: the evidence.
        explain: whether a difference gets a finding.

    Returns:
        The first batch that differs; None when none does.
    """
    plan = seen.plan
    first = first_batch_difference(seen.runs["a"], seen.runs["c"], range(plan.kill_at, plan.budget), plan.nproc)
    table.add(
        "resume: same batches",
        [f"first differs at iteration {first.iteration}{on_rank(seen, first.rank)}"] if first else [],
        f"iterations {plan.kill_at}-{plan.budget - 1}" + (f", {plan.nproc} ranks" if plan.nproc > 1 else ""),
    )
    if first and explain:
        start = seen.traces["a"].start
        facts = start[0].get("loader", {}) if start else {}
        table.explain(
            "resume: same batches",
            data_advice(first.kind, facts, first.iteration, "after resume", data_source(plan, facts)),
        )
    return first


def same_losses_and_weights(
    table: Comparison, seen: Evidence, first_batch: BatchDifference | None, explain: bool
) -> bool:
    """Row ``resume: same losses and weights``, from the interruption on.

    Args:
        table: the table, added to.
        seen: the evidence.
        first_batch: the first batch that differs after the resume (``same_batches``).
        explain: whether a difference gets a finding.

    Returns:
        Whether every loss and weight matched (then later differences are not the weights' doing).
    """
    plan = seen.plan
    i = first_differing_iteration(
        seen.traces["a"], seen.traces["c"], ("loss", "params"), range(plan.kill_at, plan.budget)
    )
    table.add("resume: same losses and weights", [f"first differs at iteration {i}"] if i is not None else [])
    # the same batches gave other losses: the state the resumed run started from is at fault
    # (other batches would explain other losses by themselves)
    if i is not None and (first_batch is None or i < first_batch.iteration) and explain:
        weights_a, weights_c = seen.checkpoints["a"].get("weights"), seen.resumed_checkpoint.get("weights")
        first_key = next(iter(diff(weights_a, weights_c)), None)
        table.explain(
            "resume: same losses and weights",
            f"iteration {i} after resume computed other losses or weights from the same batches"
            + (f" (first differing weight: {first_key})" if first_key else "")
            + ": the state the resumed run started "
            f"from is not the uninterrupted run's at iteration {plan.kill_at}. Something changes the model or the "
            "optimizer when a run resumes (a hook's before_train or after_load_checkpoint), or keeps state outside "
            "state_dict() (a buffer that is not registered, an optimizer attribute)",
        )
    return i is None


def final_part(table: Comparison, seen: Evidence, part: str, batches_held: bool, weights_held: bool) -> None:
    """Row ``resume: final <part>``: one part of the final checkpoint (``FINAL_PARTS``), less the noise.

    Args:
        table: the table, added to.
        seen: the evidence.
        part: the part's name, a key of ``FINAL_PARTS``.
        batches_held: whether every batch matched after the resume.
        weights_held: whether every loss and weight matched after the resume.
    """
    value_a, value_c = seen.checkpoints["a"][part], seen.resumed_checkpoint.get(part)
    problems = without(diff(value_a, value_c), seen.noise.checkpoint.get(part, set()))
    tensors = count_tensors(value_a)
    detail = f"{tensors} tensors" if tensors else ""
    if part == "rng" and isinstance(value_a, Mapping):
        # the streams: python, numpy, torch, cuda
        detail = ", ".join(str(k) for k in value_a)
    table.add(f"resume: final {FINAL_PARTS[part]}", [problems[0] + _and_more(problems)] if problems else [], detail)
    # an RNG stream that ended elsewhere while every batch and weight matched: the draws
    # themselves were not what differed, only how many were made
    if part == "rng" and problems and weights_held and batches_held:
        streams = sorted({p.split(".")[0] for p in problems})
        table.explain(
            "resume: final RNG streams",
            f"the RNG stream(s) {', '.join(streams)} ended elsewhere after resume although every batch and weight "
            "matched: something draws from the global generator a different number of times after a resume "
            "(a hook or the data pipeline); draw from a generator of its own, seeded from the run's seed",
        )


def same_hooks_state(table: Comparison, seen: Evidence, weights_held: bool) -> None:
    """Row ``resume: same hooks' state``: every hook's attributes at the end of training, which
    catches a hook that keeps state without a state_dict().

    Args:
        table: the table, added to.
        seen: the evidence.
        weights_held: whether every loss and weight matched after the resume.
    """
    hooks_a = (seen.traces["a"].end or {}).get("hooks", {})
    hooks_c = (seen.traces["c"].end or {}).get("hooks", {})
    problems = []
    for name, info in hooks_a.items():
        paths = diff(info.get("attrs"), hooks_c.get(name, {}).get("attrs"), f"hooks.{name}.attrs")
        attrs = without(paths, seen.noise.hook_attributes)
        if not attrs:
            continue
        # hooks.<name>.attrs.<attribute>...: the attributes, as the hook's code names them
        where = ", ".join(f"`self.{n}`" for n in sorted({p.split(".")[3] for p in attrs if len(p.split(".")) > 3}))
        problems.append(f"{name}: {where}")
        table.explain("resume: same hooks' state", _hook_message(name, info, where, weights_held))
    table.add("resume: same hooks' state", problems, f"{len(hooks_a)} hooks")


def _hook_message(name: str, info: dict, where: str, weights_held: bool) -> str:
    """The finding about a hook whose attributes `where` differ after resume."""
    cls = info.get("class", "?").rsplit(".", 1)[-1]
    if not info.get("state_dict"):
        message = (
            f"hook `{cls}` ({name}) keeps state in {where} but has no state_dict(); its state is lost on "
            "resume. Give it state_dict() returning that state and load_state_dict() restoring it"
        )
    else:
        message = (
            f"hook `{cls}` ({name}): {where} differs after resume although it has state_dict(): "
            "state_dict() leaves it out, or load_state_dict() does not restore it"
        )
    if not weights_held:
        message += " (the weights also differ after resume: fix the first finding first)"
    return message


def same_eval_metrics(table: Comparison, seen: Evidence, weights_held: bool) -> None:
    """Row ``resume: same validation and test metrics``: every validation from the interruption
    on, and every test, bit for bit.

    Args:
        table: the table, added to.
        seen: the evidence.
        weights_held: whether every loss and weight matched after the resume.
    """
    evals_c = {_eval_key(e): e for e in seen.traces["c"].evals}
    problems = []
    for key, eval_a in {_eval_key(e): e for e in seen.traces["a"].evals}.items():
        mode, iteration, _ = key
        # before the interruption the resumed run did not validate again
        if iteration < seen.plan.kill_at and mode == "val":
            continue
        eval_c = evals_c.get(key)
        if eval_c is None:
            problems.append(f"no {mode} at iteration {iteration} after resume")
            continue
        for m in sorted(set(eval_a["metrics"]) | set(eval_c["metrics"])):
            if eval_a["metrics"].get(m) != eval_c["metrics"].get(m):
                problems.append(f"{m} at iteration {iteration}")
    table.add("resume: same validation and test metrics", problems)
    # with the same weights, a metric that disagrees kept state across validations
    if not problems or not weights_held:
        return
    slots = (seen.traces["a"].end or {}).get("metrics", {})
    for name in sorted({p.split(" ")[0].split("/", 1)[-1] for p in problems if " at " in p}):
        cls = slots.get(name, {}).get("class", name)
        table.explain(
            "resume: same validation and test metrics",
            f"metric `{name}` ({cls}) gave another value after resume with the same weights: it was not reset "
            "between validations (it accumulates across them, so a resumed run, which starts it afresh, "
            "disagrees). Make reset() clear every piece of state that update() adds to",
        )


def _eval_key(record: dict) -> tuple:
    """(``val`` or ``test``, iteration, the named set): one validation or test."""
    return (record["event"], record["iter"], record.get("set"))


def same_metrics_jsonl(table: Comparison, seen: Evidence) -> list[str]:
    """Row ``resume: same metrics.jsonl``, step by step, less the timings.

    Args:
        table: the table, added to.
        seen: the evidence (``a``'s records, and the timings ``a`` and ``b`` differ in).

    Returns:
        The paths into the records by step where ``c``'s differ, for ``records_finding``.
    """
    records_c = records_by_step(read_records(seen.runs["c"].work_dir))
    problems = without(diff(seen.records["a"], records_c), seen.noise.records)
    table.add(
        "resume: same metrics.jsonl",
        [f"differs at {step_name(problems[0])}{_and_more(problems)}"] if problems else [],
        f"{len(seen.records['a'])} records",
    )
    return problems


def same_result_json(table: Comparison, seen: Evidence) -> list[str]:
    """Row ``resume: same result.json``, less what a resume says differently by design
    (``evidence.RESULT_RUN_KEYS``) and the timings.

    Args:
        table: the table, added to.
        seen: the evidence.

    Returns:
        The keys where ``c``'s result.json differs.
    """
    problems = without(diff(seen.results["a"], normalized_result(seen.runs["c"].work_dir)), seen.noise.result)
    table.add("resume: same result.json", problems[:1])
    return problems


def same_dashboards(table: Comparison, seen: Evidence) -> list[str]:
    """Rows ``resume: same TensorBoard scalars`` and ``resume: same MLflow metrics``, for the
    backends the run logs to: each series read back, point by point.

    Args:
        table: the table, added to.
        seen: the evidence.

    Returns:
        The series that differ in the first backend where any does, each as ``<backend>: <key>``.
    """
    first_differing: list[str] = []
    for backend in ("tensorboard", "mlflow"):
        if backend not in seen.plan.loggers:
            continue
        series_a, series_b, series_c = (dashboard_series(backend, seen.runs[r].work_dir, seen.plan) for r in "abc")
        # a series that differs between the same-seed runs (a timing's) is left out
        noise = {k for k in series_a if series_a.get(k) != series_b.get(k)}
        keys = sorted((set(series_a) | set(series_c)) - noise)
        differ = [k for k in keys if series_a.get(k) != series_c.get(k)]
        name = "TensorBoard scalars" if backend == "tensorboard" else "MLflow metrics"
        table.add(f"resume: same {name}", [differ[0] + _and_more(differ)] if differ else [], f"{len(keys)} series")
        first_differing = first_differing or [f"{name}: {k}" for k in differ]
    return first_differing


def records_finding(table: Comparison, records_differ: list[str], result_differs: list[str]) -> None:
    """The finding when only the records differ after resume: the training state matched (no
    other finding, no final checkpoint part differs), so a hook or logger wrote what it
    computed from the whole run without keeping it in its state_dict().

    Args:
        table: the table, added to.
        records_differ: what differs in metrics.jsonl, or else in a dashboard.
        result_differs: what differs in result.json.
    """
    differing = records_differ or result_differs
    if not differing or table.findings or table.differs("resume: final"):
        return
    table.explain(
        "resume: same records",
        f"the records differ after resume ({differing[0]}) while the training state matched: "
        "a hook or logger writes what it computed from the whole run so far without keeping it in its "
        "state_dict()",
    )
