"""``python -m expkit.reproduce <work dir>``: re-run a run from its record and prove that it reproduces.

A work dir records what produced it: ``provenance.json`` (the repository, commit, command line,
environment and the fingerprint of the data it read), ``provenance.diff`` (the uncommitted
changes) and ``.hydra/`` (the overrides). The command rebuilds that code in a temporary
``git worktree`` of the recorded repository at the recorded commit with the diff applied (the
user's working tree, index and branches are never touched; the worktree is removed at the end),
runs ``python -m expkit.train`` with the run's overrides there (cwd and ``PYTHONPATH`` the
worktree, so expkit and the user's own modules import from it; under torchrun with the recorded
world size) into ``out``, and compares the new records with the recorded ones:

- the data: the fingerprint of the files the data module read (its own finding, "the data changed");
- the config the overrides composed (``.hydra/config.yaml``);
- every value of ``metrics.jsonl`` but the timings (``*/time``, ``*/data_time``, ``*_s``, throughput);
- ``result.json``'s status, final and best metrics;
- the final weights (the last checkpoint's state_dict), where the run was deterministic: a
  seed, and the CPU or ``trainer.deterministic``.

Exact by default; ``tolerance=`` allows a relative difference. ``reproduce.json`` in ``out``
holds the verdict, the first difference (key, step, both values) and how the two environments
differ. Exit 0 reproduced, 1 differs, 2 for a dir, record or commit it cannot use. The original
run dir is only read.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from expkit.checkpoint.checkpoint_io import find_last_checkpoint, load_checkpoint_file
from expkit.config import cli
from expkit.core import hydra_compat
from expkit.core.atomic import write_json_atomic
from expkit.core.confine import confined
from expkit.core.errors import ConfigError, TaskExit, config_errors_exit_2
from expkit.sweeps.rows import _read_yaml
from expkit.workdir.records import PROVENANCE_FILE, read_job, read_provenance, read_records, read_result

__all__ = [
    "Recorded",
    "Verdict",
    "command",
    "compare_runs",
    "data_difference",
    "deterministic",
    "environment_differences",
    "main",
    "read_run",
    "run",
    "worktree",
]

REPORT = "reproduce.json"
TIMING_SUFFIXES = ("/time", "/data_time", "_s")  # what any two runs differ in: seconds, not results
ENVIRONMENT_KEYS = ("python", "torch", "cuda", "cudnn", "gpus", "threads", "host", "platform", "world_size")


@dataclass
class Recorded:
    """What a run's records say produced it, checked.

    Args:
        work_dir: the run's work dir.
        provenance: its provenance.json.
        repository: the git repository that holds the recorded commit.
        commit: the recorded commit.
        diff: provenance.diff (the uncommitted changes), or None for a clean tree.
        cwd: the run's cwd, relative to the repository (``.`` for its root).
        overrides: the run's task overrides (``.hydra/overrides.yaml``).
        config_dir: ``--config-dir`` relative to `cwd` (or absolute outside the repository), or None.
        world_size: the processes of a torchrun run; 1 for a plain one.
    """

    work_dir: Path
    provenance: dict[str, Any]
    repository: Path
    commit: str
    diff: Path | None
    cwd: str
    overrides: list[str]
    config_dir: str | None = None
    world_size: int = 1
    config: dict[str, Any] = field(default_factory=dict)


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    try:
        return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:  # no git
        return subprocess.CompletedProcess(["git", *args], 127, "", str(exc))


def _has_commit(repository: Path, commit: str) -> bool:
    return repository.is_dir() and _git(repository, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def _repository(work_dir: Path, git: dict[str, Any], commit: str) -> Path:
    """The repository that holds `commit`: the recorded one, else the one of the current directory."""
    recorded = git.get("repository")
    candidates = [Path(recorded)] if recorded else []
    here = _git(Path.cwd(), "rev-parse", "--show-toplevel")
    if here.returncode == 0:
        candidates.append(Path(here.stdout.strip()))
    for repository in candidates:
        if _has_commit(repository, commit):
            return repository
    where = " or ".join(str(c) for c in candidates) or "no repository (the current directory is not in one)"
    raise ConfigError(
        f"{work_dir}: the recorded commit {commit} is not in {where} (rebased away, or never pushed): fetch it "
        f"(git fetch origin {commit}) or run the command from a clone that has it"
    )


def _is_run(path: Path) -> bool:
    return (path / ".hydra").is_dir() and any((path / n).is_file() for n in ("result.json", "metrics.jsonl"))


def _config_dir(work_dir: Path, repository: Path, cwd: Path) -> str | None:
    """``--config-dir`` as the run gave it: relative to its cwd (`cwd`) when it lies in `repository`,
    so that it resolves in the worktree from the same place; else absolute."""
    hydra = _read_yaml(work_dir / ".hydra" / "hydra.yaml")
    sources = (
        (((hydra or {}).get("hydra") or {}).get("runtime") or {}).get("config_sources")
        if isinstance(hydra, dict)
        else None
    )
    for source in sources if isinstance(sources, list) else []:
        if isinstance(source, dict) and source.get("provider") == "command-line" and source.get("schema") == "file":
            path = Path(str(source.get("path")))
            return os.path.relpath(path, cwd) if path.is_relative_to(repository) else str(path)
    return None


def _world_size(provenance: dict[str, Any], result: dict[str, Any] | None) -> int:
    for record in (provenance, result or {}):
        size = record.get("world_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return 1


def read_run(work_dir: Path) -> Recorded:
    """The run's records, checked before anything is made.

    Args:
        work_dir: the run's work dir (a single run, or one job dir of a sweep).

    Returns:
        What produced it.

    Raises:
        ConfigError: when `work_dir` holds no run, no provenance.json, no commit (made outside git),
            a commit no repository here has, or a provenance.diff it names that is missing.
    """
    if not work_dir.is_dir():
        raise ConfigError(f"{work_dir} is not a directory: give a run's work dir (outputs/runs/<time>)")
    if not _is_run(work_dir):
        jobs = [p.name for p in sorted(work_dir.iterdir()) if p.is_dir() and _is_run(p)]
        hint = (
            f"it is a sweep dir: give one of its job dirs ({work_dir / jobs[0]})" if jobs else "give a run's work dir"
        )
        raise ConfigError(f"{work_dir} holds no run (no .hydra/ with result.json or metrics.jsonl): {hint}")
    provenance = read_provenance(work_dir)
    if provenance is None:
        raise ConfigError(
            f"{work_dir} has no readable {PROVENANCE_FILE}: nothing says which code made the run; re-run it by hand "
            "with the overrides in .hydra/overrides.yaml"
        )
    git = provenance.get("git") if isinstance(provenance.get("git"), dict) else {}
    commit = git.get("commit")
    if not isinstance(commit, str) or not commit:
        raise ConfigError(
            f"{work_dir} was made outside a git repository ({PROVENANCE_FILE} records no commit): its code cannot "
            "be rebuilt; commit your code and train again to make a run that reproduces"
        )
    repository = _repository(work_dir, git, commit)
    diff = None
    if git.get("diff"):
        diff = confined(work_dir, git["diff"], work_dir / PROVENANCE_FILE, "diff")
        if diff is None or not diff.is_file():
            raise ConfigError(
                f"{work_dir}: the run had uncommitted changes, and their record ({git['diff']}) is missing: the code "
                "cannot be rebuilt as it was"
            )
    # the paths as the run saw them: in the recorded repository (`repository` may be another clone)
    recorded_repository = Path(str(git.get("repository") or repository))
    recorded_cwd = Path(str(provenance.get("cwd") or recorded_repository))
    if not recorded_cwd.is_relative_to(recorded_repository):
        recorded_cwd = recorded_repository
    cwd = os.path.relpath(recorded_cwd, recorded_repository)
    overrides = _read_yaml(work_dir / ".hydra" / "overrides.yaml")
    config = _read_yaml(work_dir / ".hydra" / "config.yaml")
    return Recorded(
        work_dir=work_dir,
        provenance=provenance,
        repository=repository,
        commit=commit,
        diff=diff,
        cwd=cwd,
        overrides=[str(o) for o in overrides] if isinstance(overrides, list) else [],
        config_dir=_config_dir(work_dir, recorded_repository, recorded_cwd),
        world_size=_world_size(provenance, read_result(work_dir)),
        config=config if isinstance(config, dict) else {},
    )


@contextlib.contextmanager
def worktree(recorded: Recorded) -> Iterator[Path]:
    """A temporary worktree of the recorded repository at the recorded commit, the diff applied;
    removed on the way out, whatever happens (the user's own tree, index and branches untouched).

    Args:
        recorded: the run's records.

    Yields:
        The worktree's root.

    Raises:
        ConfigError: when the worktree cannot be made or the diff does not apply.
    """
    scratch = Path(tempfile.mkdtemp(prefix="expkit-reproduce-"))
    tree = scratch / "tree"
    added = False
    try:
        made = _git(recorded.repository, "worktree", "add", "--detach", "--quiet", str(tree), recorded.commit)
        if made.returncode != 0:
            raise ConfigError(f"git worktree add of {recorded.commit[:12]} failed: {_first_line(made.stderr)}")
        added = True
        if recorded.diff is not None and recorded.diff.stat().st_size:
            applied = _git(tree, "apply", "--whitespace=nowarn", str(recorded.diff.resolve()))
            if applied.returncode != 0:
                raise ConfigError(
                    f"{recorded.diff} does not apply to commit {recorded.commit[:12]} ({_first_line(applied.stderr)}): "
                    "the record is damaged or was edited; re-run by hand at that commit"
                )
        yield tree
    finally:
        if added:
            _git(recorded.repository, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(scratch, ignore_errors=True)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no message")


def command(recorded: Recorded, out: Path) -> list[str]:
    """The recorded command, its run dir moved to `out`: ``python -m expkit.train`` with the run's
    overrides (and ``--config-dir``), under torchrun for a run of several processes.

    Args:
        recorded: the run's records.
        out: the reproduction's run dir.

    Returns:
        The command line.

    Raises:
        ConfigError: a CUDA run of more processes than this machine has GPUs.
    """
    launcher = [sys.executable, "-m", "expkit.train"]
    if recorded.world_size > 1:
        import torch

        device = str((read_result(recorded.work_dir) or {}).get("device") or "")
        if device.startswith("cuda") and torch.cuda.device_count() < recorded.world_size:
            raise ConfigError(
                f"{recorded.work_dir} ran on {recorded.world_size} GPU processes and this machine has "
                f"{torch.cuda.device_count()} GPU(s): it cannot be reproduced here; run the command on a machine "
                "with as many"
            )
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={recorded.world_size}",
            "-m",
            "expkit.train",
        ]
    flags = ["--config-dir", recorded.config_dir] if recorded.config_dir else []
    return [*launcher, *flags, *recorded.overrides, f"hydra.run.dir={out}"]


def _python_path(recorded: Recorded, tree: Path, given: str) -> str:
    """PYTHONPATH for the rerun: the worktree first, then `given` (today's) with each entry that lies in
    the repository moved to the same place in the worktree (``PYTHONPATH=$PWD/src``: the user's own
    modules import from the recorded code, not from today's tree)."""
    git = recorded.provenance.get("git") or {}
    roots = {recorded.repository.absolute(), Path(str(git.get("repository") or recorded.repository))}
    entries = [str(tree)]
    for entry in filter(None, given.split(os.pathsep)):
        path = Path(entry)
        root = next((r for r in roots if path.is_absolute() and path.is_relative_to(r)), None)
        entries.append(str(tree / path.relative_to(root)) if root is not None else entry)
    return os.pathsep.join(entries)


def _rerun(recorded: Recorded, tree: Path, out: Path) -> tuple[list[str], int]:
    argv = command(recorded, out)
    cwd = tree / recorded.cwd
    env = {**os.environ, "PYTHONPATH": _python_path(recorded, tree, os.environ.get("PYTHONPATH", ""))}
    print(f"Reproducing {recorded.work_dir} at {recorded.commit[:12]}: {' '.join(argv[1:])}", flush=True)
    return argv, subprocess.run(argv, cwd=cwd if cwd.is_dir() else tree, env=env).returncode


# -- the comparison ----------------------------------------------------------------------------------
def _is_timing(key: str) -> bool:
    return key.endswith(TIMING_SUFFIXES) or "throughput" in key or "memory" in key


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(a: Any, b: Any, tolerance: float) -> bool:
    if _number(a) and _number(b):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or abs(a - b) <= tolerance * max(abs(a), abs(b))
    return a == b


def _difference(what: str, key: str, step: Any, original: Any, reproduced: Any) -> dict[str, Any]:
    return {"what": what, "key": key, "step": step, "original": original, "reproduced": reproduced}


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _config_difference(original: dict[str, Any], reproduced: dict[str, Any]) -> dict[str, Any] | None:
    a, b = _flat(original), _flat(reproduced)
    for key in [*a, *(k for k in b if k not in a)]:
        if a.get(key) != b.get(key):
            return _difference("config", key, None, a.get(key), b.get(key))
    return None


def _records_difference(original: Path, reproduced: Path, tolerance: float) -> tuple[dict[str, Any] | None, int]:
    """The first value of metrics.jsonl that differs (record by record, timings aside); the values compared."""
    a, b = read_records(original), read_records(reproduced)
    compared = 0
    for i, (old, new) in enumerate(zip(a, b)):
        step = old.get("step", i)
        for key in [*old, *(k for k in new if k not in old)]:
            if _is_timing(key):
                continue
            compared += 1
            if key not in old or key not in new or not _same(old[key], new[key], tolerance):
                return _difference("metrics.jsonl", key, step, old.get(key), new.get(key)), compared
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        step = longer[min(len(a), len(b))].get("step")
        return _difference("metrics.jsonl", "records", step, len(a), len(b)), compared
    return None, compared


def _result_difference(original: Path, reproduced: Path, tolerance: float) -> tuple[dict[str, Any] | None, int]:
    """The first of result.json's status, final and best metrics that differs; the values compared."""
    a, b = read_result(original) or {}, read_result(reproduced) or {}
    step = a.get("iter")
    if a.get("status") != b.get("status"):
        return _difference("result.json", "status", step, a.get("status"), b.get("status")), 1
    pairs: list[tuple[str, Any, Any]] = []
    finals_a, finals_b = a.get("final_metrics") or {}, b.get("final_metrics") or {}
    for key in [*finals_a, *(k for k in finals_b if k not in finals_a)]:
        if not _is_timing(key):
            pairs.append((f"final_metrics.{key}", finals_a.get(key), finals_b.get(key)))
    bests_a, bests_b = a.get("best_metrics") or {}, b.get("best_metrics") or {}
    for key in [*bests_a, *(k for k in bests_b if k not in bests_a)]:
        old, new = bests_a.get(key) or {}, bests_b.get(key) or {}
        for part in ("value", "epoch", "iter"):
            pairs.append((f"best_metrics.{key}.{part}", old.get(part), new.get(part)))
    for compared, (key, old, new) in enumerate(pairs, start=1):
        if not _same(old, new, tolerance):
            return _difference("result.json", key, step, old, new), compared
    return None, len(pairs) + 1


def deterministic(config: dict[str, Any], result: dict[str, Any] | None) -> str | None:
    """Why the final weights must be equal bit for bit: a seed, and the CPU or trainer.deterministic.

    Args:
        config: the run's config (``.hydra/config.yaml``).
        result: its result.json (``device``), or None.

    Returns:
        The reason in words; None when the run was not deterministic.
    """
    trainer = config.get("trainer") or {}
    if trainer.get("seed") is None:
        return None
    if trainer.get("deterministic"):
        return "trainer.deterministic"
    return "a seeded CPU run" if str((result or {}).get("device") or "").startswith("cpu") else None


def _unequal(x: Any, y: Any, tolerance: float) -> int | None:
    """The index of the first element of two flat tensors that differs: bit for bit (0.0 and -0.0,
    two NaNs, told apart as stored) or beyond a relative `tolerance`; None when none does."""
    import torch

    if tolerance == 0 or not x.is_floating_point():
        size = x.element_size()
        bytes_x, bytes_y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        where = (bytes_x != bytes_y).nonzero()
        return int(where[0]) // size if len(where) else None
    close = torch.isclose(x.double(), y.double(), rtol=tolerance, atol=0, equal_nan=True)
    where = (~close).nonzero()
    return int(where[0]) if len(where) else None


def _weights_difference(original: Path, reproduced: Path, tolerance: float) -> tuple[dict[str, Any] | None, str]:
    """The first tensor of the last checkpoint's state_dict that differs; what was compared, in words."""
    import torch

    paths = [find_last_checkpoint(original), find_last_checkpoint(reproduced)]
    if any(p is None or not p.is_file() for p in paths):
        return None, "not compared: a run has no checkpoint file (none kept, or a sharded .dcp checkpoint)"
    old, new = (load_checkpoint_file(p, "the last checkpoint") for p in paths)  # type: ignore[arg-type]
    step = (old.get("meta") or {}).get("iter") if isinstance(old.get("meta"), dict) else None
    a, b = old["state_dict"], new["state_dict"]
    for key in [*a, *(k for k in b if k not in a)]:
        if key not in a or key not in b:
            return _difference("weights", key, step, key in a, key in b), f"{len(a)} tensors"
        x, y = a[key], b[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return _difference("weights", key, step, str((x.dtype, tuple(x.shape))), str((y.dtype, tuple(y.shape)))), ""
        unequal = _unequal(x.reshape(-1), y.reshape(-1), tolerance)
        if unequal is not None:
            return _difference("weights", key, step, x.reshape(-1)[unequal].item(), y.reshape(-1)[unequal].item()), ""
    how = "bit for bit" if tolerance == 0 else f"within {tolerance:g}"
    return None, f"{len(a)} tensors equal {how}"


def data_difference(original: dict[str, Any], reproduced: dict[str, Any]) -> dict[str, Any] | None:
    """The data changed: the first input whose fingerprint differs between two provenance records.

    Args:
        original: the run's provenance.json.
        reproduced: the reproduction's.

    Returns:
        The finding (``what: data``; the file, both fingerprints), or None when both read the same
            files, or either record has no fingerprint.
    """
    a, b = original.get("inputs"), reproduced.get("inputs")
    if not isinstance(a, dict) or not isinstance(b, dict) or a.get("digest") == b.get("digest"):
        return None
    old = {e.get("path"): e for e in a.get("entries") or [] if isinstance(e, dict)}
    new = {e.get("path"): e for e in b.get("entries") or [] if isinstance(e, dict)}
    for path in [*old, *(p for p in new if p not in old)]:
        if old.get(path) != new.get(path):
            return _difference("data", str(path), None, old.get(path), new.get(path))
    return _difference("data", "inputs", None, a.get("digest"), b.get("digest"))


@dataclass
class Verdict:
    """What the comparison found: the first difference of the results, the data's own finding, and
    a line per check."""

    difference: dict[str, Any] | None
    data: dict[str, Any] | None
    checks: list[tuple[str, str]]

    @property
    def reproduced(self) -> bool:
        return self.difference is None and self.data is None


def compare_runs(recorded: Recorded, reproduced: Path, tolerance: float) -> Verdict:
    """The reproduction's records against the run's: data, config, metrics.jsonl, result.json, weights.

    Args:
        recorded: the run's records.
        reproduced: the reproduction's run dir.
        tolerance: the relative difference allowed (0: exact).

    Returns:
        The verdict.
    """
    data = data_difference(recorded.provenance, read_provenance(reproduced) or {})
    inputs = recorded.provenance.get("inputs")
    checks = [("data", "changed" if data else "same files" if isinstance(inputs, dict) else "not recorded by the run")]
    config = _read_yaml(reproduced / ".hydra" / "config.yaml")
    difference = _config_difference(recorded.config, config if isinstance(config, dict) else {})
    checks.append(("config", "differs" if difference else "same"))
    if difference is None:
        difference, n = _records_difference(recorded.work_dir, reproduced, tolerance)
        checks.append(("metrics.jsonl", f"{n} values: {'differ' if difference else 'same'}"))
    if difference is None:
        difference, n = _result_difference(recorded.work_dir, reproduced, tolerance)
        checks.append(("result.json", f"{n} values: {'differ' if difference else 'same'}"))
    if difference is None:
        why = deterministic(recorded.config, read_result(recorded.work_dir))
        if why is None:
            checks.append(
                (
                    "weights",
                    "not compared: the run was not deterministic (no seed; a GPU run without trainer.deterministic)",
                )
            )
        else:
            difference, said = _weights_difference(recorded.work_dir, reproduced, tolerance)
            checks.append(("weights", f"differ ({why})" if difference else f"{said} ({why})"))
    return Verdict(difference, data, checks)


def environment_differences(original: dict[str, Any], reproduced: dict[str, Any]) -> list[dict[str, Any]]:
    """How two provenance records' environments differ: versions, devices, threads, host, packages.

    Args:
        original: the run's provenance.json.
        reproduced: the reproduction's.

    Returns:
        One entry per difference: ``what``, ``original``, ``reproduced``.
    """
    found = [
        {"what": key, "original": original.get(key), "reproduced": reproduced.get(key)}
        for key in ENVIRONMENT_KEYS
        if original.get(key) != reproduced.get(key)
    ]
    old, new = (
        dict(str(p).partition("==")[::2] for p in (record.get("packages") or []) if isinstance(p, str))
        for record in (original, reproduced)
    )
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            found.append({"what": f"package {name}", "original": old.get(name), "reproduced": new.get(name)})
    return found


# -- the report --------------------------------------------------------------------------------------
def _said(difference: dict[str, Any]) -> str:
    step = "" if difference["step"] is None else f" at step {difference['step']}"
    return f"{difference['what']} {difference['key']}{step}: {difference['original']!r} recorded, {difference['reproduced']!r} now"


def _report(recorded: Recorded, out: Path, argv: list[str], verdict: Verdict, tolerance: float) -> dict[str, Any]:
    environment = environment_differences(recorded.provenance, read_provenance(out) or {})
    report = {
        "verdict": "reproduced" if verdict.reproduced else "differs",
        "run": str(recorded.work_dir.resolve()),
        "reproduction": str(out.resolve()),
        "commit": recorded.commit,
        "diff": None if recorded.diff is None else recorded.diff.name,
        "command": argv[1:],
        "tolerance": tolerance,
        "data_changed": verdict.data,
        "first_difference": verdict.difference,
        "checks": dict(verdict.checks),
        "environment": environment,
    }
    write_json_atomic(out / REPORT, report)
    return report


def _print_table(report: dict[str, Any], verdict: Verdict) -> None:
    environment = report["environment"]
    env_text = (
        "same"
        if not environment
        else "; ".join(f"{e['what']} {e['original']} -> {e['reproduced']}" for e in environment[:4])
        + (f" and {len(environment) - 4} more" if len(environment) > 4 else "")
    )
    rows = [("commit", report["commit"][:12] + (f" + {report['diff']}" if report["diff"] else "")), *verdict.checks]
    rows.append(("environment", env_text))
    width = max(len(name) for name, _ in rows)
    print(f"\nReproduce {report['run']}\n       -> {report['reproduction']}")
    for name, text in rows:
        print(f"  {name:<{width}}  {text}")
    if verdict.data is not None:
        print(f"The data changed: {_said(verdict.data)}")
    if verdict.difference is not None:
        print(f"First difference: {_said(verdict.difference)}")
    print(f"Verdict: {report['verdict']}  ({Path(report['reproduction']) / REPORT})")


# -- the command -------------------------------------------------------------------------------------
def _out_dir(work_dir: Path, given: Any) -> Path:
    """`given`, else beside the run: ``<run>-reproduced-<time>``; for a sweep's job, beside its sweep dir
    (``<sweep>-<job>-reproduced-<time>``: a dir inside the sweep dir would be read as one more job)."""
    stamp = time.strftime("%Y%m%d_%H%M%S")
    work_dir = work_dir.absolute()
    if given:
        out = Path(str(given)).absolute()
    elif read_job(work_dir) is not None or (work_dir.parent / "multirun.yaml").is_file():
        out = work_dir.parent.parent / f"{work_dir.parent.name}-{work_dir.name}-reproduced-{stamp}"
    else:
        out = work_dir.parent / f"{work_dir.name}-reproduced-{stamp}"
    if out.resolve() == work_dir.resolve() or work_dir.resolve() in out.resolve().parents:
        raise ConfigError(f"out={out} lies in the run's own dir, which is never written: give a dir outside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"out={out} exists and is not empty: give a new dir")
    return out


def _tolerance(value: Any) -> float:
    if not _number(value) or not 0 <= value < 1:
        raise ConfigError(f"tolerance={value}: give a relative tolerance in [0, 1), e.g. tolerance=1e-6 (0: exact)")
    return float(value)


def _reproduce(cfg: DictConfig) -> int:
    if not cfg.get("run"):
        raise ConfigError("which run? give its work dir: python -m expkit.reproduce outputs/runs/<time>")
    tolerance = _tolerance(cfg.get("tolerance"))
    recorded = read_run(Path(str(cfg.run)))
    out = _out_dir(recorded.work_dir, cfg.get("out"))
    command(recorded, out)  # (a world size this machine cannot run: refused before the worktree is made)
    with worktree(recorded) as tree:
        argv, status = _rerun(recorded, tree, out)
    if not (out / ".hydra").is_dir():
        raise ConfigError(f"the reproduction stopped before its run began (exit {status}): see its message above")
    verdict = compare_runs(recorded, out, tolerance)
    report = _report(recorded, out, argv, verdict, tolerance)
    _print_table(report, verdict)
    return 0 if verdict.reproduced else 1


@hydra_compat.main(config_path="conf", config_name="reproduce")
def run(cfg: DictConfig) -> None:
    """Hydra's task function: exit 0 reproduced, 1 differs, 2 with one line for input it cannot use.

    Args:
        cfg: the composed ``reproduce.yaml`` config; Hydra composes it from the command line and
            passes it, so the function is called with no arguments (as ``main`` does).

    Raises:
        TaskExit: with the status.
    """
    with config_errors_exit_2():
        status = _reproduce(cfg)
    raise TaskExit(status)


def _hydra_argv(argv: list[str]) -> list[str]:
    """A bare word (the run's work dir) as Hydra's ``run=<dir>``."""
    out = []
    for token in cli.tokens(argv):
        arg = token[0]
        if len(token) == 1 and not arg.startswith("-") and ("=" not in arg or Path(arg).is_dir()):
            out.append(f"run={cli.hydra_quoted(arg)}")
        else:
            out += token
    return out


def main() -> None:
    """``python -m expkit.reproduce``: a Hydra app over conf/reproduce.yaml (``--help``, ``--cfg job``).

    Raises:
        SystemExit: 0 reproduced, 1 differs, 2 for bad input (also Hydra's own errors).
    """
    cli.dirs_command_main(run, _hydra_argv)


if __name__ == "__main__":
    main()
