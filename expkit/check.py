"""``python -m expkit.check``: prove that an experiment is reproducible and resumes exactly,
and name what breaks it.

The check is a Hydra app over the same config as ``expkit.train`` (``check.yaml`` includes
``train.yaml``): the user passes the overrides, ``--config-dir`` and experiment they train with.
It trains that experiment for a short budget in a scratch dir, as real ``expkit.train``
processes, each with ``expkit.check_probe.CheckProbe`` added:

- ``a`` and ``b``: two runs from the same seed. They must match bit for bit.
- ``c``: the same run, killed with SIGKILL right after a checkpoint in the middle of an epoch,
  then resumed with ``resume=true``. It must match ``a``: the batches each iteration saw, the
  losses and weights, the final weights, optimizer, scheduler, hooks' state and RNG streams,
  the validation and test metrics, metrics.jsonl and result.json.

What differs between ``a`` and ``b`` only in a timing (an iteration's seconds, a timer hook's
clock) is what any two runs differ in; it is left out of every comparison. Each difference
found becomes a finding that names the piece at fault and what to change. Exit 0 when all
match, 1 on any divergence, 2 on bad input. A report goes to ``check.out`` (under ``outputs/``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from expkit.check_probe import KILL_AT_ENV, records_name
from expkit.config import cli
from expkit.core import hydra_compat, versions
from expkit.core.errors import ConfigError, TaskExit, exit_status, task_exits

__all__ = [
    "DETERMINISM_WARNING",
    "RESULT_RUN_KEYS",
    "SETTINGS",
    "TIMING",
    "TORCHRUN_ENV",
    "Comparison",
    "Finding",
    "Plan",
    "Row",
    "Run",
    "RunFailed",
    "Trace",
    "compare",
    "diff",
    "main",
    "plan",
    "read_trace",
    "render",
    "run",
    "split_argv",
    "train_all",
    "validate_settings",
]


log = logging.getLogger("expkit")

# keys of records, checkpoints and hooks that hold a clock reading or a duration: any two runs
# differ in them (found again at every check: a key that also differs between the two
# uninterrupted runs is left out, whatever its name)
TIMING = re.compile(
    r"(^|[/_.])(time|times|data_time|eta|elapsed|since|start|started|wall|wall_time_s|spent_s|"
    r"speed|throughput|seconds|secs|duration|timestamp|last_flush|smoothed)([/_.]|$)",
    re.IGNORECASE,
)
# what a resumed run's result.json says differently by design
RESULT_RUN_KEYS = {
    "wall_time_s",
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
TORCHRUN_ENV = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
}  # (the check's own, not its runs')
DETERMINISM_WARNING = re.compile(r"(\S+) does not have a deterministic implementation")
# the keys of check.yaml's `check:`, in its order
SETTINGS = ("iters", "kill_at", "keep", "dir", "out")


# -- the plan ---------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What the check trains: each run's budget and where the interrupted run is killed.

    Args:
        steps_per_epoch: the optimizer steps of one epoch (per process).
        budget: the iterations each run trains.
        kill_at: the iteration whose checkpoint the interrupted run dies right after.
        checkpoints: whether the run has a checkpoint hook (without one nothing can resume).
        nproc: the processes per run (under ``torchrun ... -m expkit.check``: as many as it started).
        loggers: the ``logger`` settings by backend name.
        scratch: the scratch dir where the runs' work dirs (and an MLflow store) go.
        data_option: the ``data=`` option the config was composed with (None when unknown).
        data_class: the data module's class (``data._target_``).
    """

    steps_per_epoch: int
    budget: int  # iterations each run trains
    kill_at: int  # the checkpoint the interrupted run dies right after
    checkpoints: bool  # the run has a checkpoint hook (else nothing can resume)
    nproc: int = 1  # processes per run (torchrun ... -m expkit.check: as many as it started)
    loggers: dict[str, Any] = field(default_factory=dict)  # logger=[...]: name -> settings
    scratch: Path = Path()  # (where the runs' work dirs and an MLflow store go)
    data_option: str | None = None  # data=NAME (None: composed without the group)
    data_class: str | None = None  # data._target_


def plan(cfg: DictConfig, nproc: int = 1) -> Plan:
    """The budget and the interruption point, from the train loader's length: by default an
    epoch and a half (the first epoch's end and its validation are crossed), killed halfway
    through the second epoch; never more than the run's own budget.

    Builds the data module to count the train loader's batches. ``check.iters`` and
    ``check.kill_at`` override the defaults.

    Args:
        cfg: the composed config (``check.yaml``: train.yaml's keys and ``check``).
        nproc: the processes per run; each rank then takes its share of every epoch.

    Returns:
        The plan (its ``scratch`` still unset).

    Raises:
        ConfigError: when ``trainer.seed`` is null, the budget is under 2 iterations, or
            ``check.kill_at`` is not inside the budget.
    """
    from expkit.config.build import build_trainer_settings, instantiate_node
    from expkit.core.rng import seed_everything

    settings = build_trainer_settings(cfg)
    if settings.seed is None:
        raise ConfigError("trainer.seed is null: a run without a seed cannot be reproduced; set trainer.seed=0")
    seed_everything(settings.seed)
    data = instantiate_node(cfg.data, "data")
    loader = data.loaders()[0]
    batches = len(loader)
    if nproc > 1 and getattr(loader, "batch_size", None):  # each rank takes its share of every epoch
        per_rank = math.ceil(len(loader.sampler) / nproc)
        batches = math.ceil(per_rank / loader.batch_size)
    steps = settings.steps_per_epoch(batches)
    total = settings.max_iters or settings.max_epochs * steps  # type: ignore[operator]
    given = cfg.check.get("iters")
    budget = int(given) if given is not None else min(total, steps + max(2, steps // 2))
    if budget < 2:
        raise ConfigError(
            f"check.iters={budget}: the check needs at least 2 iterations (one before the "
            "interruption, one after); give check.iters=2 or more"
        )
    kill = cfg.check.get("kill_at")
    if kill is None:
        kill = steps + (budget - steps) // 2 if budget >= steps + 2 else max(1, budget // 2)
    kill = int(kill)
    if not 1 <= kill < budget:
        raise ConfigError(
            f"check.kill_at={kill}: the interruption must fall inside the budget, between 1 and "
            f"{budget - 1} (check.iters={budget})"
        )
    checkpoints = cfg.get("default_hooks", {}).get("checkpoint") is not None
    from omegaconf import OmegaConf

    node = cfg.get("logger")
    given = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else {}
    loggers = {k: v for k, v in (given or {}).items() if isinstance(v, dict)}  # type: ignore[union-attr]
    from hydra.core.hydra_config import HydraConfig

    # a finding about the data names the option and the class, as the user would type them
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    p = Plan(steps, budget, kill, checkpoints, nproc, loggers)
    p.data_option, p.data_class = choices.get("data"), cfg.data.get("_target_")
    return p


def validate_settings(check: DictConfig) -> None:
    """Refuse, before anything trains, a ``check.`` setting the check does not have or cannot
    read, and a scratch dir or report path it cannot write in: three runs take minutes, and
    the report is written after them.

    Args:
        check: the composed ``check`` node.

    Raises:
        ConfigError: naming the setting and what to type instead.
    """
    unknown = [str(k) for k in check if k not in SETTINGS]
    if unknown:
        known = ", ".join(f"check.{k}" for k in SETTINGS)
        raise ConfigError(f"check.{unknown[0]}: the check has no such setting; its settings: {known}")
    for key in ("iters", "kill_at"):
        value = check.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"check.{key}={value}: give a number of iterations (e.g. check.{key}=40) or null")
    if not isinstance(check.get("keep"), bool):
        raise ConfigError(f"check.keep={check.get('keep')}: give check.keep=true or check.keep=false")
    scratch = check.get("dir")
    _writable(
        Path(str(scratch) if scratch is not None else tempfile.gettempdir()),
        f"check.dir={'null' if scratch is None else scratch}",
        "check.dir=<a directory you can write in>",
    )
    if check.get("out"):
        _writable(
            Path(str(check.out)).parent,
            f"check.out={check.out}",
            "check.out=<a path you can write to> (or check.out=null for no report)",
        )


def _writable(directory: Path, setting: str, instead: str) -> None:
    """Raise unless a file can be made in `directory`, or while it is missing in the nearest dir
    above it (tried with a file that is gone at once: nothing is left behind on bad input)."""
    there = directory.absolute()
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise ConfigError(f"{setting}: {there} is a file; give {instead}")
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot write in {there} ({exc.strerror or exc}); give {instead}") from None


# -- the runs -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """One run of the check and what its processes left.

    Args:
        name: ``a``, ``b`` or ``c``.
        work_dir: the run's work dir.
        returncodes: the exit status of each process started for it, in order.
        output: the processes' output (stdout and stderr), joined.
        seconds: the wall-clock time its processes took, in seconds.
    """

    name: str
    work_dir: Path
    returncodes: list[int] = field(default_factory=list)
    output: str = ""
    seconds: float = 0.0


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(what each training run gets: the flags and overrides as typed, less the check's own keys
    and the dirs the check chooses; refused keys) .

    Args:
        argv: the check's command line, without the program name.

    Returns:
        The arguments each training run gets (``check.*``, ``hydra.run.dir`` and
            ``hydra.output_subdir`` left out), and the refused ones (``-m``/``--multirun``,
            ``resume``, ``hydra.sweep.*``).
    """
    out, refused, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in cli.VALUED_FLAGS and i + 1 < len(argv):
            out += [arg, argv[i + 1]]
            i += 2
            continue
        key = arg.partition("=")[0].lstrip("+~")
        if arg in ("-m", "--multirun"):
            refused.append(arg)
        elif key.split(".")[0] == "check" or key in ("hydra.run.dir", "hydra.output_subdir"):
            pass
        elif key in ("resume",) or key.startswith("hydra.sweep"):
            refused.append(arg)
        else:
            out.append(arg)
        i += 1
    return out, refused


def _start(run: Run, argv: list[str], p: Plan, *, resume: bool = False, kill: bool = False) -> subprocess.Popen:
    """One ``expkit.train`` process of the check, its output to a file in the scratch dir."""
    extra = [
        f"hydra.run.dir={run.work_dir}",
        "default_hooks.logger.progress=false",
        "+hooks.check_probe._target_=expkit.check_probe.CheckProbe",
        f"+hooks.check_probe.stop_at={p.budget}",
    ]
    if p.checkpoints:
        extra += [
            "default_hooks.checkpoint.by_epoch=false",
            f"default_hooks.checkpoint.interval={p.kill_at}",
            "default_hooks.checkpoint.out_dir=null",
            "default_hooks.checkpoint.max_keep_ckpts=-1",
        ]
    if resume:
        extra.append("resume=true")
    env = {
        k: v
        for k, v in os.environ.items()
        if k != KILL_AT_ENV and k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")
    }
    env["WANDB_MODE"] = "offline"  # (the check's runs are not the user's: never synced)
    if "mlflow" in p.loggers:  # a store of the check's own, no artifacts (MLflow would put them in ./mlruns)
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{p.scratch / 'mlflow.db'}"
        extra += ["logger.mlflow.tracking_uri=null", "logger.mlflow.artifacts=false"]
    if kill:
        env[KILL_AT_ENV] = str(p.kill_at)
    env["HYDRA_FULL_ERROR"] = "0"
    # three runs at once share the cores: torch's threads each (all the cores by default) would
    # contend, spinning (a recurrent model trained 4x slower here); every run gets the same count
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (3 * p.nproc))))
    run.work_dir.parent.mkdir(parents=True, exist_ok=True)
    sink = open(run.work_dir.parent / f"{run.name}{len(run.returncodes)}.out", "w+")  # noqa: SIM115  (closed in _wait)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={p.nproc}"]
    python = launcher if p.nproc > 1 else [sys.executable]
    proc = subprocess.Popen(
        [*python, "-m", "expkit.train", *cli.flags_first([*argv, *extra])],
        env=env,
        stdout=sink,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc.sink, proc.started = sink, time.perf_counter()  # type: ignore[attr-defined]
    return proc


def _wait(run: Run, proc: subprocess.Popen) -> int:
    rc = proc.wait()
    run.seconds += time.perf_counter() - proc.started  # type: ignore[attr-defined]
    proc.sink.seek(0)  # type: ignore[attr-defined]
    run.output += proc.sink.read()  # type: ignore[attr-defined]
    proc.sink.close()  # type: ignore[attr-defined]
    run.returncodes.append(rc)
    return rc


def train_all(runs: dict[str, Run], argv: list[str], p: Plan) -> None:
    """a, b and the interrupted c at once (most of each is start-up, on one core), then c's
    resume. A run that does not even start (the first error of the experiment) stops it all.

    Args:
        runs: the runs by name (``a``, ``b``, ``c``); their return codes and output are filled in.
        argv: the training runs' arguments (``split_argv``).
        p: the plan.

    Raises:
        ConfigError: when run ``a`` exits 2 (bad input).
        RunFailed: when run ``a`` fails otherwise.
    """
    procs = {"a": _start(runs["a"], argv, p), "b": _start(runs["b"], argv, p)}
    if p.checkpoints:
        procs["c"] = _start(runs["c"], argv, p, kill=True)
    try:
        for name, proc in procs.items():
            _wait(runs[name], proc)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if runs["a"].returncodes[-1] == 2:  # (expkit.train's exit for bad input)
        raise ConfigError(_failed_run(runs["a"]).removeprefix("Error: "))
    if runs["a"].returncodes[-1] != 0:
        raise RunFailed(f"the experiment does not train: {_failed_run(runs['a']).removeprefix('Error: ')}")
    if p.checkpoints and read_trace(runs["c"].work_dir).killed:  # (torchrun exits 1 when a rank is killed)
        _wait(runs["c"], _start(runs["c"], argv, p, resume=True))


def _failed_run(run: Run) -> str:
    lines = [ln for ln in run.output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error")]
    return (errors[-1] if errors else "\n".join(lines[-5:])) or f"exit {run.returncodes[-1]}"


# -- reading what the runs left -------------------------------------------------------------------------
@dataclass
class Trace:
    """One run's probe records, by kind; an iteration seen twice keeps its last record.

    Args:
        start: the records of each start (a resumed run has two).
        iters: the record of each iteration, by iteration.
        evals: the validation and test records, in order.
        end: the record of the end of training; None when the run did not get there.
        killed: whether the run killed itself after the checkpoint it waited for.
    """

    start: list[dict[str, Any]]
    iters: dict[int, dict[str, Any]]
    evals: list[dict[str, Any]]
    end: dict[str, Any] | None
    killed: bool


def read_trace(work_dir: Path, rank: int = 0) -> Trace:
    """The probe records a run left; lines that cannot be parsed (cut by the kill) are skipped.

    Args:
        work_dir: the run's work dir.
        rank: the rank whose records are read.

    Returns:
        The records by kind (all empty when the file is missing).
    """
    start, iters, evals, end, killed = [], {}, [], None, False
    path = work_dir / records_name(rank)
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # (a line cut by the kill)
            continue
        kind = rec.get("event")
        if kind == "start":
            start.append(rec)
        elif kind == "iter":
            iters[rec["iter"]] = rec
        elif kind in ("val", "test"):
            evals.append(rec)
        elif kind == "end":
            end = rec
        elif kind == "killed":
            killed = True
    return Trace(start, iters, evals, end, killed)


def _records(work_dir: Path) -> list[dict[str, Any]]:
    path = work_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _final_checkpoint(work_dir: Path) -> dict[str, Any] | None:
    """The run's last checkpoint, read as expkit reads any checkpoint (tensors and plain
    containers only; the pointer confined to the run's own checkpoints/)."""
    from expkit.checkpoint import checkpoint_io

    path = checkpoint_io.find_last_checkpoint(work_dir)
    if path is None:
        return None
    try:
        if path.is_dir():  # a sharded (FSDP2) checkpoint: its state, every tensor of it whole
            from expkit.checkpoint import sharding

            state = sharding.read_state(path, "check")
            state["sharded"].pop("path", None)  # (the run's own dir)
            tensors = sharding.read_tensors(path)
            return {**state, "state_dict": tensors.pop("model", {}), **tensors}
        return checkpoint_io.load_checkpoint(path, "check")
    except ConfigError:
        return None


# -- comparing ---------------------------------------------------------------------------------------
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
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(
                torch.equal(a, b)
                or (
                    a.is_floating_point()
                    and torch.equal(a.isnan(), b.isnan())
                    and torch.equal(a.nan_to_num(), b.nan_to_num())
                )
            )
        )
        return [] if same else [path or "."]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [path or "."]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append(sub)
            else:
                out += diff(a[k], b[k], sub)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [path or "."]
        return [
            p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in diff(x, y, f"{path}.{i}" if path else str(i))
        ]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [path or "."]


def _count_tensors(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, Mapping):
        return sum(_count_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_count_tensors(v) for v in value)
    return 0


def _timing(path: str) -> bool:
    return bool(TIMING.search(path))


@dataclass
class Finding:
    """A difference the check explains: what breaks reproducibility or resuming, and the fix.

    Args:
        check: the check (row) it belongs to.
        message: the explanation, naming the piece at fault and what to change.
    """

    check: str
    message: str


@dataclass
class Row:
    """One row of the check's table.

    Args:
        check: what is compared.
        result: ``ok``, ``differs``, ``skipped`` or ``info``.
        detail: the first difference, or what was compared.
    """

    check: str
    result: str  # ok | differs | skipped
    detail: str = ""


@dataclass
class Comparison:
    """The check's table and findings.

    Args:
        rows: the table's rows, in order.
        findings: the differences explained.
    """

    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def add(self, check: str, problems: list[str], ok_detail: str = "") -> None:
        """Add a row: ``differs`` with the first problem as its detail, else ``ok``.

        Args:
            check: what is compared.
            problems: the differences found; empty when none.
            ok_detail: the detail of an ``ok`` row.
        """
        self.rows.append(Row(check, "differs" if problems else "ok", problems[0] if problems else ok_detail))


def _first_iter(x: Trace, y: Trace, keys: tuple[str, ...], iters: Iterable[int]) -> int | None:
    """The first iteration both traces hold whose records differ in any of `keys`."""
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


def _eval_key(e: dict[str, Any]) -> tuple:
    return (e["event"], e["iter"], e.get("set"))


def _loader(t: Trace) -> dict[str, Any]:
    return t.start[0].get("loader", {}) if t.start else {}


def _data_source(p: Plan, facts: dict[str, Any]) -> str:
    """What a finding about the data names: ``data=clock_seeded (`checkfix.ClockSeededAugmentation`,
    its train dataset `checkfix._Augmented`)``."""
    what = [f"`{p.data_class}`"] if p.data_class else []
    if facts.get("dataset"):
        what.append(f"its train dataset `{facts['dataset']}`")
    name = f"data={p.data_option}" if p.data_option else "data"
    return f"{name} ({', '.join(what)})" if what else name


def _data_advice(kind: str, facts: dict[str, Any], i: int, when: str, source: str) -> str:
    sampler = facts.get("sampler_name", "?")
    if kind in ("order", "samples"):
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


def _volatile_paths(a: Any, b: Any) -> set[str]:
    """Paths that differ between the two uninterrupted runs and are timings: left out."""
    return {p for p in diff(a, b) if _timing(p)}


def _without(paths: list[str], volatile: set[str]) -> list[str]:
    return [p for p in paths if p not in volatile and not _timing(p)]


def _checkpoint_parts(ckpt: dict[str, Any] | None) -> dict[str, Any]:
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


def _normalized_result(work_dir: Path) -> dict[str, Any]:
    path = work_dir / "result.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    text = json.dumps({k: v for k, v in result.items() if k not in RESULT_RUN_KEYS})
    return json.loads(text.replace(str(work_dir.resolve()), "<work_dir>").replace(str(work_dir), "<work_dir>"))


def _records_by_step(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    out: dict[tuple, dict[str, Any]] = {}
    for r in records:
        kind = tuple(sorted({k.split("/")[0] for k in r if "/" in k}))
        out[(r.get("iter"), r.get("epoch"), kind)] = r
    return out


def _first_batch(x: Run, y: Run, iters: range, nproc: int) -> tuple[int, int, str] | None:
    """(iteration, rank, how) of the first batch that differs between two runs, on any rank."""
    found = []
    for rank in range(nproc):
        tx, ty = read_trace(x.work_dir, rank), read_trace(y.work_dir, rank)
        i = _first_iter(tx, ty, ("samples",), iters)
        if i is not None:
            found.append((i, rank, _sample_kind(tx.iters[i], ty.iters[i])))
    return min(found) if found else None


def compare(a: Run, b: Run, c: Run, p: Plan, outputs: str) -> Comparison:
    """Compare the runs: ``a`` with ``b`` (the same seed), then ``a`` with the resumed ``c``.

    Differences in timings, and whatever differs between ``a`` and ``b`` in the hooks' state,
    are left out. When ``a`` and ``b`` already differ, the findings about the resume are
    dropped (they follow from it).

    Args:
        a: the first run from the seed.
        b: the second run from the same seed.
        c: the run killed after a checkpoint and resumed.
        p: the plan.
        outputs: the runs' output, searched for the ops torch flags as non-deterministic.

    Returns:
        The table's rows and the findings.
    """
    ta, tb, tc = read_trace(a.work_dir), read_trace(b.work_dir), read_trace(c.work_dir)

    def on_rank(rank: int) -> str:
        return f" on rank {rank}" if p.nproc > 1 else ""

    cmp = Comparison()
    iters = range(p.budget)
    facts = _loader(ta)
    source = _data_source(p, facts)

    # -- ops torch names as non-deterministic (warn_only mode, from every run's output)
    flagged = sorted(set(DETERMINISM_WARNING.findall(outputs)))
    res_a, res_b = _normalized_result(a.work_dir), _normalized_result(b.work_dir)
    device = res_a.get("device") or "this device"
    for op in flagged:
        cmp.findings.append(
            Finding(
                "deterministic algorithms",
                (
                    f"`torch.use_deterministic_algorithms` flagged `{op}` on {device}: its results may differ run to run. "
                    "Replace the op (or the module that calls it) with a deterministic one, or accept the difference and "
                    "leave trainer.deterministic=false"
                ),
            )
        )
    cmp.rows.append(
        Row(
            "deterministic algorithms",
            "differs" if flagged else "ok",
            ", ".join(flagged) if flagged else "no op without a deterministic implementation ran",
        )
    )

    # -- determinism: a and b
    first = _first_batch(a, b, iters, p.nproc)
    i = first[0] if first else None
    cmp.add(
        "same seed: same batches",
        [f"first differs at iteration {i}{on_rank(first[1])}"] if first else [],
        f"{len(ta.iters)} iterations" + (f", {p.nproc} ranks" if p.nproc > 1 else ""),
    )
    if first:
        cmp.findings.append(
            Finding(
                "same seed: same batches",
                _data_advice(first[2], facts, i, f"of a second run from the same seed{on_rank(first[1])}", source),
            )
        )
    j = _first_iter(ta, tb, ("loss", "params"), iters)
    cmp.add("same seed: same losses and weights", [f"first differs at iteration {j}"] if j is not None else [])
    if j is not None and (i is None or j < i) and not flagged:
        cmp.findings.append(
            Finding(
                "same seed: same losses and weights",
                (
                    f"iteration {j} of two runs from the same seed saw the same batches but computed other losses or "
                    "weights: the model or the step draws randomness expkit's seed does not fix (an unseeded generator, "
                    "the clock), or runs an op whose result varies run to run; trainer.deterministic=true names such ops"
                ),
            )
        )

    ckpt_a, ckpt_b = _checkpoint_parts(_final_checkpoint(a.work_dir)), _checkpoint_parts(_final_checkpoint(b.work_dir))
    # hooks' state that differs between two runs from the same seed (a timer's averages) cannot
    # tell a resume apart: it is left out, and said so; any other part must match
    volatile = {
        name: set(diff(ckpt_a[name], ckpt_b.get(name)))
        if name == "hooks"
        else _volatile_paths(ckpt_a[name], ckpt_b.get(name))
        for name in ckpt_a
    }
    left_out = sorted(volatile.get("hooks", set()))
    state_problems = [
        f"{name}: {path}" for name in ckpt_a for path in _without(diff(ckpt_a[name], ckpt_b.get(name)), volatile[name])
    ]
    cmp.add(
        "same seed: same final state",
        state_problems[:1] + ([f"(and {len(state_problems) - 1} more)"] if len(state_problems) > 1 else []),
    )

    rec_a, rec_b = _records_by_step(_records(a.work_dir)), _records_by_step(_records(b.work_dir))
    rec_volatile = _volatile_paths(rec_a, rec_b)
    rec_problems = _without(diff(rec_a, rec_b), rec_volatile)
    cmp.add(
        "same seed: same metrics.jsonl",
        [f"differs at {_step_name(rec_problems[0])}"] if rec_problems else [],
        f"{len(rec_a)} records",
    )

    hook_volatile = set(diff((ta.end or {}).get("hooks"), (tb.end or {}).get("hooks"), "hooks"))
    left_out += sorted(p_.split(".", 1)[1].replace(".attrs.", ".") for p_ in hook_volatile)
    if left_out:
        cmp.rows.append(Row("left out: differ between same-seed runs", "info", ", ".join(sorted(set(left_out)))))

    # -- resume: a and c (what already differs between a and b is reported once, above)
    # (an op torch flags is named above; it need not have made these two runs differ)
    determinism_failed = any(r.result == "differs" for r in cmp.rows if r.check.startswith("same seed"))
    if not p.checkpoints:
        cmp.rows.append(
            Row(
                "resume", "skipped", "the run has no checkpoint hook (default_hooks.checkpoint): nothing to resume from"
            )
        )
        return cmp
    if not tc.killed:
        cmp.rows.append(
            Row(
                "interrupted after a checkpoint",
                "differs",
                f"no checkpoint at iteration {p.kill_at} appeared: the run was not interrupted",
            )
        )
        cmp.findings.append(
            Finding(
                "interrupted after a checkpoint",
                (
                    f"the run saved no checkpoint at iteration {p.kill_at} (default_hooks.checkpoint with by_epoch=false, "
                    f"interval={p.kill_at}): a hook of the run may stop or change checkpointing; pick another point with "
                    "check.kill_at=N"
                ),
            )
        )
        return cmp
    cmp.rows.append(
        Row(
            "interrupted after a checkpoint",
            "ok",
            f"SIGKILL after iteration {p.kill_at} (epoch {p.kill_at // p.steps_per_epoch + 1}, "
            f"batch {p.kill_at % p.steps_per_epoch} of {p.steps_per_epoch}), resumed",
        )
    )
    after = range(p.kill_at, p.budget)
    first = _first_batch(a, c, after, p.nproc)
    i = first[0] if first else None
    cmp.add(
        "resume: same batches",
        [f"first differs at iteration {i}{on_rank(first[1])}"] if first else [],
        f"iterations {p.kill_at}-{p.budget - 1}" + (f", {p.nproc} ranks" if p.nproc > 1 else ""),
    )
    if first and not determinism_failed:
        cmp.findings.append(Finding("resume: same batches", _data_advice(first[2], facts, i, "after resume", source)))
    j = _first_iter(ta, tc, ("loss", "params"), after)
    cmp.add("resume: same losses and weights", [f"first differs at iteration {j}"] if j is not None else [])
    weights_held = j is None
    ckpt_c = _checkpoint_parts(_final_checkpoint(c.work_dir))
    if j is not None and (i is None or j < i) and not determinism_failed:
        first_key = next(iter(diff(ckpt_a.get("weights"), ckpt_c.get("weights"))), None)
        cmp.findings.append(
            Finding(
                "resume: same losses and weights",
                (
                    f"iteration {j} after resume computed other losses or weights from the same batches"
                    + (f" (first differing weight: {first_key})" if first_key else "")
                    + ": the state the resumed run started "
                    f"from is not the uninterrupted run's at iteration {p.kill_at}. Something changes the model or the optimizer "
                    "when a run resumes (a hook's before_train or after_load_checkpoint), or keeps state outside "
                    "state_dict() (a buffer that is not registered, an optimizer attribute)"
                ),
            )
        )

    for name, label in (
        ("weights", "weights"),
        ("optimizer", "optimizer"),
        ("scheduler", "scheduler"),
        ("rng", "RNG streams"),
        ("hooks", "hooks' checkpointed state"),
        ("position", "position, best metrics"),
        ("other", "other checkpoint entries"),
    ):
        if name not in ckpt_a:
            continue
        problems = _without(diff(ckpt_a[name], ckpt_c.get(name)), volatile.get(name, set()))
        tensors = _count_tensors(ckpt_a[name])
        detail = f"{tensors} tensors" if tensors else ""
        if name == "rng" and isinstance(ckpt_a[name], Mapping):
            detail = ", ".join(str(k) for k in ckpt_a[name])  # (the streams: python, numpy, torch, cuda)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        cmp.add(f"resume: final {label}", [problems[0] + more] if problems else [], detail)
        if name == "rng" and problems and weights_held and i is None:
            streams = sorted({pp.split(".")[0] for pp in problems})
            cmp.findings.append(
                Finding(
                    "resume: final RNG streams",
                    (
                        f"the RNG stream(s) {', '.join(streams)} ended elsewhere after resume although every batch and weight "
                        "matched: something draws from the global generator a different number of times after a resume "
                        "(a hook or the data pipeline); draw from a generator of its own, seeded from the run's seed"
                    ),
                )
            )

    # hooks' attributes (a hook that keeps state without a state_dict())
    hooks_a, hooks_c = (ta.end or {}).get("hooks", {}), (tc.end or {}).get("hooks", {})
    hook_problems = []
    for name, info in hooks_a.items():
        other = hooks_c.get(name, {})
        attrs = [
            pp
            for pp in diff(info.get("attrs"), other.get("attrs"), f"hooks.{name}.attrs")
            if pp not in hook_volatile and not _timing(pp)
        ]
        if not attrs:
            continue
        names = sorted({pp.split(".")[3] for pp in attrs if len(pp.split(".")) > 3})
        where = ", ".join(f"`self.{n}`" for n in names)
        hook_problems.append(f"{name}: {where}")
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
        cmp.findings.append(Finding("resume: same hooks' state", message))
    cmp.add("resume: same hooks' state", hook_problems, f"{len(hooks_a)} hooks")

    # validation and test metrics, and the metric objects
    evals_a = {_eval_key(e): e for e in ta.evals}
    evals_c = {_eval_key(e): e for e in tc.evals}
    metric_problems = []
    for key, ea in evals_a.items():
        if key[1] < p.kill_at and key[0] == "val":
            continue  # (before the interruption: the resumed run did not validate again)
        ec = evals_c.get(key)
        if ec is None:
            metric_problems.append(f"no {key[0]} at iteration {key[1]} after resume")
            continue
        for m in sorted(set(ea["metrics"]) | set(ec["metrics"])):
            if ea["metrics"].get(m) != ec["metrics"].get(m):
                metric_problems.append(f"{m} at iteration {key[1]}")
    cmp.add("resume: same validation and test metrics", metric_problems)
    if metric_problems:
        slots = (ta.end or {}).get("metrics", {})
        bad = sorted({mp.split(" ")[0].split("/", 1)[-1] for mp in metric_problems if " at " in mp})
        for name in bad:
            slot = slots.get(name, {})
            cls = slot.get("class", name)
            if weights_held:
                cmp.findings.append(
                    Finding(
                        "resume: same validation and test metrics",
                        (
                            f"metric `{name}` ({cls}) gave another value after resume with the same weights: it was not reset "
                            "between validations (it accumulates across them, so a resumed run, which starts it afresh, "
                            "disagrees). Make reset() clear every piece of state that update() adds to"
                        ),
                    )
                )

    # the records
    rec_c = _records_by_step(_records(c.work_dir))
    rec_problems = _without(diff(rec_a, rec_c), rec_volatile)
    cmp.add(
        "resume: same metrics.jsonl",
        [
            f"differs at {_step_name(rec_problems[0])}"
            + (f" (and {len(rec_problems) - 1} more)" if len(rec_problems) > 1 else "")
        ]
        if rec_problems
        else [],
        f"{len(rec_a)} records",
    )
    res_c = _normalized_result(c.work_dir)
    res_volatile = _volatile_paths(res_a, res_b)
    res_problems = _without(diff(res_a, res_c), res_volatile)
    cmp.add("resume: same result.json", res_problems[:1])
    for backend in ("tensorboard", "mlflow"):
        if backend in p.loggers:
            series = [_dashboard(backend, r.work_dir, p) for r in (a, b, c)]
            dash_volatile = {k for k in series[0] if series[0].get(k) != series[1].get(k)}
            keys = sorted((set(series[0]) | set(series[2])) - dash_volatile)
            differ = [k for k in keys if series[0].get(k) != series[2].get(k)]
            name = "TensorBoard scalars" if backend == "tensorboard" else "MLflow metrics"
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            cmp.add(f"resume: same {name}", [differ[0] + more] if differ else [], f"{len(keys)} series")
            rec_problems = rec_problems or [f"{name}: {k}" for k in differ]
    if (
        (rec_problems or res_problems)
        and not cmp.findings
        and not any(r.result == "differs" for r in cmp.rows if r.check.startswith("resume: final"))
    ):
        cmp.findings.append(
            Finding(
                "resume: same records",
                (
                    f"the records differ after resume ({(rec_problems or res_problems)[0]}) while the training state matched: "
                    "a hook or logger writes what it computed from the whole run so far without keeping it in its "
                    "state_dict()"
                ),
            )
        )
    if determinism_failed:  # what differs after resume follows from what differs between two same-seed runs
        cmp.findings = [f for f in cmp.findings if not f.check.startswith(("resume", "interrupted"))]
    return cmp


def _dashboard(backend: str, work_dir: Path, p: Plan) -> dict[str, list[tuple[int, str]]]:
    """A run's series in TensorBoard (its event files, read back) or MLflow (its run in the
    check's store), by key: (step, value) sorted, each point once (MLflow keeps the points an
    interrupted attempt logged past its checkpoint, and the resumed attempt logs them again)."""
    out: dict[str, list[tuple[int, str]]] = {}
    if backend == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        log_dir = work_dir / str(p.loggers["tensorboard"].get("log_dir") or "tb")
        if not log_dir.is_dir():
            return out
        events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags().get("scalars", []):
            out[tag] = sorted({(e.step, float.hex(e.value)) for e in events.Scalars(tag)})
        return out
    from mlflow.tracking import MlflowClient

    id_file = work_dir / "mlflow" / "run_id"
    if not id_file.is_file():
        return out
    client = MlflowClient(tracking_uri=f"sqlite:///{p.scratch / 'mlflow.db'}")
    run_id = id_file.read_text().strip()
    for key in client.get_run(run_id).data.metrics:
        out[key] = sorted({(m.step, float.hex(m.value)) for m in client.get_metric_history(run_id, key)})
    return out


def _step_name(path: str) -> str:
    """`(40, 1, ('val',)).val/acc` -> `iter 40, val/acc`."""
    m = re.match(r"\((\w+), (\w+), \(([^)]*)\)\)\.?(.*)", path)
    if not m:
        return path
    return f"iter {m.group(1)}" + (f", {m.group(4)}" if m.group(4) else "")


# -- the report -------------------------------------------------------------------------------------------
def render(rows: list[Row], findings: list[Finding]) -> str:
    """The check's report as text: the table, then the findings under "What breaks it:".

    Args:
        rows: the table's rows (at least one).
        findings: the findings; none adds no section.

    Returns:
        The report's lines, joined.
    """
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  {'result':<8}  detail", f"{'-' * width}  {'-' * 8}  {'-' * 6}"]
    lines += [f"{r.check:<{width}}  {r.result:<8}  {r.detail}" for r in rows]
    if findings:
        lines += ["", "What breaks it:"]
        lines += [f"  - {f.message}" for f in findings]
    return "\n".join(lines)


@hydra_compat.main(config_path="conf", config_name="check")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: bad input exits 2, a run that fails later 1, each with one line.

    Args:
        cfg: the composed ``check.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Raises:
        SystemExit: with status 2 for bad input, 1 when a run fails or the runs differ; nothing
            when everything matches.
    """
    try:
        with task_exits():
            _check(cfg)
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2) from None
    except RunFailed as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(1) from None


def _check(cfg: DictConfig) -> None:
    validate_settings(cfg.check)
    argv, _ = split_argv(sys.argv[1:])
    p = plan(cfg, _processes())
    given_dir = cfg.check.get("dir")
    if given_dir is not None:
        Path(given_dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="expkit-check-", dir=given_dir))
    p.scratch = scratch.resolve()
    log.info(
        "Checking %s iterations a run (%d a epoch), interrupted after iteration %d; scratch dir %s",
        p.budget,
        p.steps_per_epoch,
        p.kill_at,
        scratch,
    )
    started = time.perf_counter()
    try:
        runs = {name: Run(name, scratch / name) for name in "abc"}
        train_all(runs, argv, p)
        failed = [
            r
            for r in runs.values()
            if r.returncodes
            and r.returncodes[-1] != 0
            and not (r.name == "c" and len(r.returncodes) == 1 and read_trace(r.work_dir).killed)
        ]
        if failed:
            raise RunFailed(f"run {failed[0].name} failed: {_failed_run(failed[0])}")
        outputs = "".join(r.output for r in runs.values())
        result = compare(runs["a"], runs["b"], runs["c"], p, outputs)
    finally:
        if not cfg.check.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    training = sum(r.seconds for r in runs.values())
    ok = not result.findings and all(r.result != "differs" for r in result.rows)
    print(render(result.rows, result.findings))
    print(
        f"\n{'OK: reproducible and resumes exactly' if ok else 'DIFFERS'} ({p.budget} iterations a run; "
        f"{seconds:.1f} s in all, {training:.1f} s in the runs){'' if not cfg.check.keep else f'; runs kept in {scratch}'}"
    )
    out = cfg.check.get("out")
    if out:
        report = {
            "ok": ok,
            "budget": p.budget,
            "kill_at": p.kill_at,
            "steps_per_epoch": p.steps_per_epoch,
            "seconds": round(seconds, 2),
            "run_seconds": {r.name: round(r.seconds, 2) for r in runs.values()},
            "rows": [vars(r) for r in result.rows],
            "findings": [vars(f) for f in result.findings],
            "scratch": str(scratch) if cfg.check.keep else None,
        }
        from expkit.core import atomic

        atomic.write_text_atomic(Path(out), json.dumps(report, indent=2) + "\n")
        print(f"Report: {out}")
    if not ok:
        sys.exit(1)


class RunFailed(Exception):
    """A run of the check failed in a way no comparison can read (not the first: that is input)."""


def _processes() -> int:
    """Processes per run: ``torchrun --nproc_per_node=N -m expkit.check`` starts its runs with N."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _under_torchrun() -> None:
    """torchrun --nproc_per_node=N -m expkit.check: rank 0 runs the check, starting each run with
    torchrun on N processes; the other ranks have nothing to do and end at once."""
    world = _processes()
    if world <= 1:
        return
    if int(os.environ.get("LOCAL_WORLD_SIZE", world) or world) != world:
        print(
            f"Error: the check runs on one machine (torchrun --nnodes=1); this torchrun spans "
            f"{world // int(os.environ['LOCAL_WORLD_SIZE'])} nodes",
            file=sys.stderr,
        )
        sys.exit(2)
    if int(os.environ.get("RANK", "0") or 0) != 0:
        sys.exit(0)


def main() -> None:
    """``python -m expkit.check``: check the command line, then run the Hydra app (``run``).

    Raises:
        SystemExit: with status 2 for bad input (also Hydra's own errors), 1 when a run fails or
            the runs differ, 130 after Ctrl-C; under torchrun, 0 at once on ranks other than 0.
    """
    versions.require()
    _under_torchrun()
    argv = sys.argv[1:]
    refused = split_argv(argv)[1]
    message = (
        (
            f"{refused[0]}: the check runs one experiment, from scratch, in a scratch dir of its own; leave out "
            "-m, resume= and hydra.sweep.* (pass the overrides you train with)"
        )
        if refused
        else None
    )
    message = (
        message
        or cli.check_keys(argv)
        or cli.check_group_choices([a for a in argv if not a.lstrip("+~").startswith("check.")])
    )
    if message:
        print(f"Error: {message}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = cli.flags_first(argv)
    try:
        run()
    except KeyboardInterrupt:  # Ctrl-C: the runs were stopped (and the scratch dir removed, unless kept)
        print("\nInterrupted: the check stopped its runs; nothing was checked", file=sys.stderr)
        sys.exit(130)
    except SystemExit as exc:
        sys.exit(exit_status(exc))


if __name__ == "__main__":
    main()
