"""What the runs left, read back for the comparisons: each run's probe trace, final checkpoint,
metrics.jsonl, result.json and dashboards; and what the two runs from one seed differ in anyway,
which no comparison counts."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expkit.check.differences import diff, timing_differences
from expkit.check.planning import Plan
from expkit.check.traces import Trace, read_trace
from expkit.check.training_runs import Run
from expkit.core.errors import ConfigError
from expkit.workdir.records import read_records, read_result

__all__ = [
    "RESULT_RUN_KEYS",
    "Evidence",
    "SameSeedNoise",
    "checkpoint_parts",
    "dashboard_series",
    "final_checkpoint",
    "normalized_result",
    "read_evidence",
    "records_by_step",
    "step_name",
]

# what a resumed run's result.json says differently by design
RESULT_RUN_KEYS = {
    "wall_time_s",
    "segment_wall_time_s",
    "command",
    "overrides",
    "provenance",
    "work_dir",
    "traceback",
    "resumed_from",
    "resumes",
    "requeues",
    "restarts",
    "run_info",
}


@dataclass
class SameSeedNoise:
    """What the two runs from one seed differ in anyway: no resume can be told apart by it, so
    every comparison leaves it out.

    Args:
        checkpoint: by part of the final checkpoint, the paths that differ: every one in the
            hooks' state (a timer's averages), the timings elsewhere.
        records: the timings that differ in metrics.jsonl (by step).
        result: the timings that differ in result.json.
        hook_attributes: the hooks' attributes that differ at the end of training
            (``hooks.<name>.attrs.<attribute>...``).
    """

    checkpoint: dict[str, set[str]]
    records: set[str]
    result: set[str]
    hook_attributes: set[str]


@dataclass
class Evidence:
    """What the runs left, read once.

    Args:
        plan: the plan.
        runs: the runs by name (``a``, ``b``, ``c``).
        traces: rank 0's probe trace of each run, by name.
        checkpoints: the final checkpoint of ``a`` and ``b`` by part (``checkpoint_parts``).
        records: metrics.jsonl of ``a`` and ``b`` by step (``records_by_step``).
        results: result.json of ``a`` and ``b`` (``normalized_result``).
        noise: what ``a`` and ``b`` differ in anyway.
    """

    plan: Plan
    runs: dict[str, Run]
    traces: dict[str, Trace]
    checkpoints: dict[str, dict[str, Any]]
    records: dict[str, dict[tuple, dict[str, Any]]]
    results: dict[str, dict[str, Any]]
    noise: SameSeedNoise

    @functools.cached_property
    def resumed_checkpoint(self) -> dict[str, Any]:
        """The final checkpoint of the resumed run ``c``, by part; read when first asked for."""
        return checkpoint_parts(final_checkpoint(self.runs["c"].work_dir))


def read_evidence(runs: dict[str, Run], plan: Plan) -> Evidence:
    """Read what the runs left, and what the same-seed runs differ in anyway.

    Args:
        runs: the runs by name (``a``, ``b``, ``c``), trained.
        plan: the plan.

    Returns:
        The evidence.
    """
    a, b = runs["a"].work_dir, runs["b"].work_dir
    traces = {name: read_trace(run.work_dir) for name, run in runs.items()}
    checkpoints = {"a": checkpoint_parts(final_checkpoint(a)), "b": checkpoint_parts(final_checkpoint(b))}
    records = {"a": records_by_step(read_records(a)), "b": records_by_step(read_records(b))}
    results = {"a": normalized_result(a), "b": normalized_result(b)}
    # a hook's state may differ between two runs from one seed (a timer's averages): all of it is
    # left out, and the table says so; in any other part only the timings are
    ckpt_a, ckpt_b = checkpoints["a"], checkpoints["b"]
    noise = SameSeedNoise(
        checkpoint={
            part: set(diff(ckpt_a[part], ckpt_b.get(part)))
            if part == "hooks"
            else timing_differences(ckpt_a[part], ckpt_b.get(part))
            for part in ckpt_a
        },
        records=timing_differences(records["a"], records["b"]),
        result=timing_differences(results["a"], results["b"]),
        hook_attributes=set(diff((traces["a"].end or {}).get("hooks"), (traces["b"].end or {}).get("hooks"), "hooks")),
    )
    return Evidence(plan, runs, traces, checkpoints, records, results, noise)


def records_by_step(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Records by (iteration, epoch, the prefixes of their keys): a step logged twice (before a
    kill and again after the resume) keeps its last record.

    Args:
        records: metrics.jsonl's records (``expkit.workdir.records.read_records``).

    Returns:
        The records by step.
    """
    by_step: dict[tuple, dict[str, Any]] = {}
    for r in records:
        kind = tuple(sorted({k.split("/")[0] for k in r if "/" in k}))
        by_step[(r.get("iter"), r.get("epoch"), kind)] = r
    return by_step


def step_name(path: str) -> str:
    """`(40, 1, ('val',)).val/acc` -> `iter 40, val/acc`: a path into ``records_by_step`` as
    the table says it.

    Args:
        path: a path ``diff`` returned for two runs' records by step.

    Returns:
        The path named by its iteration and key; `path` itself when it is not such a path.
    """
    m = re.match(r"\((\w+), (\w+), \(([^)]*)\)\)\.?(.*)", path)
    if not m:
        return path
    return f"iter {m.group(1)}" + (f", {m.group(4)}" if m.group(4) else "")


def final_checkpoint(work_dir: Path) -> dict[str, Any] | None:
    """The run's last checkpoint, read as expkit reads any checkpoint (tensors and plain
    containers only; the pointer confined to the run's own checkpoints/).

    Args:
        work_dir: the run's work dir.

    Returns:
        The checkpoint; a sharded one with every tensor whole; None when there is none or it
            cannot be read.
    """
    from expkit.checkpoint import checkpoint_io

    path = checkpoint_io.find_last_checkpoint(work_dir)
    if path is None:
        return None
    try:
        if path.is_dir():
            # a sharded (FSDP2) checkpoint: its state, and every tensor of it whole; less the path
            # to its own dir, which differs from run to run
            from expkit.checkpoint import dcp

            state = checkpoint_io.read_sharded_state(path, "check")
            state["sharded"].pop("path", None)
            tensors = dcp.read_tensors(path)
            return {**state, "state_dict": tensors.pop("model", {}), **tensors}
        return checkpoint_io.load_checkpoint(path, "check")
    except ConfigError:
        return None


def checkpoint_parts(ckpt: dict[str, Any] | None) -> dict[str, Any]:
    """A checkpoint cut into the parts the table compares one row each.

    Args:
        ckpt: the checkpoint (``final_checkpoint``), or None.

    Returns:
        ``weights``, ``optimizer``, ``scheduler``, ``hooks``, ``rng``, ``position`` (epoch,
            iteration, best and last metrics) and ``other`` (every other entry, the config
            left out); empty for None.
    """
    if ckpt is None:
        return {}
    meta = ckpt.get("meta", {})
    parts = {
        "weights": ckpt.get("state_dict"),
        "optimizer": {k: v for k, v in ckpt.items() if k.startswith("optimizer")},
        "scheduler": {k: v for k, v in ckpt.items() if k.startswith(("scheduler", "param_scheduler"))},
        "hooks": ckpt.get("hooks"),
        "rng": ckpt.get("rng"),
        "position": {k: meta.get(k) for k in ("epoch", "iter", "inner_iter", "best_metrics", "val_metrics")},
    }
    known = {"meta", "config", "state_dict", "hooks", "rng"}
    parts["other"] = {
        k: v
        for k, v in ckpt.items()
        if k not in known and not k.startswith(("optimizer", "scheduler", "param_scheduler"))
    }
    return parts


def normalized_result(work_dir: Path) -> dict[str, Any]:
    """A run's result.json less what a resumed run says differently by design (``RESULT_RUN_KEYS``),
    its work dir written ``<work_dir>``.

    Args:
        work_dir: the run's work dir.

    Returns:
        The result; empty when there is none (``read_result``: missing, torn or foreign).
    """
    result = read_result(work_dir) or {}
    text = json.dumps({k: v for k, v in result.items() if k not in RESULT_RUN_KEYS})
    return json.loads(text.replace(str(work_dir.resolve()), "<work_dir>").replace(str(work_dir), "<work_dir>"))


def dashboard_series(backend: str, work_dir: Path, plan: Plan) -> dict[str, list[tuple[int, str]]]:
    """A run's series in TensorBoard (its event files, read back) or MLflow (its run in the
    check's store), by key: (step, value) sorted, each point once (MLflow keeps the points an
    interrupted attempt logged past its checkpoint, and the resumed attempt logs them again).

    Args:
        backend: ``tensorboard`` or ``mlflow``.
        work_dir: the run's work dir.
        plan: the plan (the loggers' settings, the scratch dir with the MLflow store).

    Returns:
        The points of each series, values as float hex; empty when the run logged none.
    """
    if backend == "tensorboard":
        return _tensorboard_series(work_dir / str(plan.loggers["tensorboard"].get("log_dir") or "tb"))
    return _mlflow_series(work_dir, plan.scratch / "mlflow.db")


def _tensorboard_series(log_dir: Path) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not log_dir.is_dir():
        return {}
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: sorted({(e.step, float.hex(e.value)) for e in events.Scalars(tag)})
        for tag in events.Tags().get("scalars", [])
    }


def _mlflow_series(work_dir: Path, store: Path) -> dict[str, list[tuple[int, str]]]:
    from mlflow.tracking import MlflowClient

    id_file = work_dir / "mlflow" / "run_id"
    if not id_file.is_file():
        return {}
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    run_id = id_file.read_text().strip()
    return {
        key: sorted({(m.step, float.hex(m.value)) for m in client.get_metric_history(run_id, key)})
        for key in client.get_run(run_id).data.metrics
    }
