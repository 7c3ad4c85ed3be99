"""What produced a work dir: code version, environment, machine, command and time.

Written as ``provenance.json`` when a run starts training (git's process runs meanwhile,
during its before_run hooks, metric probe and resume) and completed at its end, with
``provenance.diff`` when the git tree had uncommitted changes; result.json points to it.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from expkit.core import distributed
from expkit.core.atomic import write_json_atomic, write_text_atomic

__all__ = ["collect", "finish", "installed_packages", "start"]


log = logging.getLogger("expkit")


def _git_start(args: list[str], cwd: Path) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(["git", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:  # no git
        return None


def _git_output(proc: subprocess.Popen | None) -> str | None:
    if proc is None:
        return None
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    return out if proc.returncode == 0 else None


def _git(args: list[str], cwd: Path) -> str | None:
    return _git_output(_git_start(args, cwd))


def _work_tree(cwd: Path) -> Path | None:
    """The git working tree `cwd` is in, found as git finds it: the nearest directory up that
    holds a ``.git`` (a directory, or a file in worktrees and submodules); None outside one.
    With ``GIT_DIR`` set, git decides: ``GIT_WORK_TREE``, else `cwd`."""
    if "GIT_DIR" in os.environ:
        return Path(os.environ.get("GIT_WORK_TREE") or cwd)
    cwd = cwd.absolute()
    for directory in (cwd, *cwd.parents):
        if os.path.exists(os.path.join(directory, ".git")):
            return directory
    return None


def _holds(entry: Path, work_dir: Path) -> bool:
    """Whether `entry` is `work_dir`, one of its parents, or inside it."""
    entry, work_dir = entry.resolve(), work_dir.resolve()
    return entry == work_dir or entry in work_dir.parents or work_dir in entry.parents


class _GitQuery:
    """git's answers about `cwd`: one process (``git status --porcelain=v2 --branch`` gives the
    commit, the branch and the changed files), started now and read later; none outside a
    working tree (each process costs about a millisecond to start)."""

    def __init__(self, cwd: Path) -> None:
        self.tree = _work_tree(cwd)
        self.status = (
            _git_start(
                ["-c", "status.relativePaths=false", "status", "--porcelain=v2", "--branch", "--no-ahead-behind"], cwd
            )
            if self.tree
            else None
        )

    def state(self, work_dir: Path | None = None) -> dict[str, Any]:
        """`work_dir`: the run's own dir; an untracked entry that holds it or lies in it is expkit's
        output (``outputs/`` of a project without a .gitignore for it), not a change to the code."""
        out = _git_output(self.status)
        if out is None:  # not a working tree, no git, or git refused (e.g. a repository of another user)
            return {"repository": None}
        commit = branch = None
        changed = []
        for line in out.splitlines():
            kind, _, rest = line.partition(" ")
            if line.startswith("# branch.oid "):
                commit = line.split(" ", 2)[2]
            elif line.startswith("# branch.head "):
                branch = line.split(" ", 2)[2]
            elif kind == "1":  # changed: XY sub mH mI mW hH hI path
                changed.append(rest.split(" ", 7)[7])
            elif kind == "2":  # renamed or copied: ... X score path<TAB>original
                path, _, original = rest.split(" ", 8)[8].partition("\t")
                changed.append(f"{original} -> {path}")
            elif kind == "u":  # unmerged: XY sub m1 m2 m3 mW h1 h2 h3 path
                changed.append(rest.split(" ", 9)[9])
            elif kind == "?" and not (self.tree and work_dir and _holds(self.tree / rest, work_dir)):  # untracked
                changed.append(rest)
        if commit in (None, "(initial)"):  # no commit yet
            return {"repository": None}
        return {
            "repository": str(self.tree),
            "commit": commit,
            "branch": "HEAD" if branch == "(detached)" else branch,  # (as git rev-parse --abbrev-ref says)
            "dirty": bool(changed),
            "changed_files": changed,
        }


def installed_packages() -> list[str]:
    """name==version of every installed distribution, from the ``*.dist-info`` folder names
    on sys.path (parsing each METADATA file instead takes about 0.1 s).

    Returns:
        ``name==version`` of each distribution, the name lower-cased with ``_`` as ``-``, sorted; where
        a name is found in several sys.path entries, the first entry's version.
    """
    found: dict[str, str] = {}
    stdlib = os.path.dirname(os.__file__)
    skipped = {stdlib, os.path.join(stdlib, "lib-dynload")}  # (no distributions there; 200 files to list)
    for entry in sys.path:
        if entry in skipped:
            continue
        try:
            names = [n for n in os.listdir(entry or ".") if n.endswith(".dist-info")]
        except OSError:
            continue
        for name in names:
            package, _, version = name[: -len(".dist-info")].partition("-")
            found.setdefault(package.lower().replace("_", "-"), version)
    return sorted(f"{name}=={version}" for name, version in found.items())


def _platform() -> str:
    """platform.platform()'s answer on Linux ("Linux-6.1.0-x86_64-with-glibc2.36") without its
    first-call cost (1.4 ms here: it runs ``uname -p`` in a subprocess for the processor)."""
    uname = os.uname()
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError, AttributeError):  # not glibc (macOS, musl)
        return platform.platform()
    return f"{uname.sysname}-{uname.release}-{uname.machine}-with-{(libc or '').replace(' ', '')}"


def collect(cwd: Path | None = None) -> dict[str, Any]:
    """The record but git's part ("git" stays empty: ``start`` asks git alongside the run).

    Args:
        cwd: the directory the command runs in; None: the current directory.

    Returns:
        The command, cwd, start time, an empty ``git``, the Python, torch, CUDA and cuDNN versions, torch's
        CPU threads,
        the GPU names, the host, the platform and the installed packages; in a process group, its
        ``world_size``, ``nodes`` and ``processes_per_node`` too.
    """
    cwd = cwd or Path.cwd()
    cuda = torch.cuda.is_available()
    return {
        "command": sys.argv,
        "cwd": str(cwd),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": {},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "host": socket.gethostname(),
        "threads": torch.get_num_threads(),
        **distributed.world_info(),
        "platform": _platform(),
        "packages": installed_packages(),
    }


UNTRACKED_BYTES = 1 << 20  # an untracked file larger than this is named in the record, not copied into the diff
UNTRACKED_FILES = 200  # at most this many untracked files go into the diff


def _untracked_diff(tree: Path, work_dir: Path, git: dict[str, Any]) -> str:
    """The untracked files (not ignored) as a diff that creates them: ``git diff HEAD`` leaves them
    out, and a new module the run imported is part of its code. Files in `work_dir`, larger than
    ``UNTRACKED_BYTES`` or past ``UNTRACKED_FILES`` are listed in ``git["untracked_left_out"]``."""
    listed = _git(["ls-files", "--others", "--exclude-standard", "-z"], tree) or ""
    parts, left_out = [], []
    for name in filter(None, listed.split("\0")):
        path = tree / name
        if _holds(path, work_dir):
            continue
        if len(parts) >= UNTRACKED_FILES or not path.is_file() or path.stat().st_size > UNTRACKED_BYTES:
            left_out.append(name)
            continue
        proc = _git_start(["diff", "--no-index", "--binary", "--", "/dev/null", name], tree)
        if proc is not None:
            out, _ = proc.communicate(timeout=10)
            parts.append(out if proc.returncode == 1 else "")  # (1: the files differ, as they do)
    if left_out:
        git["untracked_left_out"] = left_out
    return "".join(parts)


def _write(work_dir: Path, info: dict[str, Any]) -> None:
    if info["git"].get("dirty"):
        diff = _git(["diff", "--binary", "HEAD"], Path(info["cwd"])) or ""
        diff += _untracked_diff(Path(info["git"]["repository"]), work_dir, info["git"])
        write_text_atomic(work_dir / "provenance.diff", diff)
        info["git"]["diff"] = "provenance.diff"
    write_json_atomic(work_dir / "provenance.json", info)


def start(
    work_dir: Path, cwd: Path | None = None, inputs: dict[str, Any] | None = None
) -> Callable[[], dict[str, Any]]:
    """provenance.json (and provenance.diff for a dirty tree) in `work_dir`, in two steps:
    git's process starts now and runs on another core while the caller goes on (the Runner:
    its before_run hooks and metric probe); the returned function reads its answer and
    writes the files, once (later calls give the same record). It never raises: a file it
    cannot write is logged, as the run's last records are.

    Args:
        work_dir: the run directory, where the files are written; entries inside it are not counted
            as changes to the code.
        cwd: the directory the command runs in, where git is asked; None: the current directory.
        inputs: the fingerprint of the files the run reads (``expkit.data.inputs``), kept as
            ``inputs``; None: not recorded.

    Returns:
        The function that completes the record with git's part, writes the files the first time it
        is called, and returns the record.
    """
    info = collect(cwd)
    if inputs is not None:
        info["inputs"] = inputs
    query = _GitQuery(Path(info["cwd"]))
    done = False

    def finish_writing() -> dict[str, Any]:
        nonlocal done
        if not done:
            done = True
            info["git"] = query.state(work_dir)
            try:
                _write(work_dir, info)
            except OSError as exc:  # a full or read-only disk: the run's own records say more
                log.error("Could not write %s: %s", work_dir / "provenance.json", exc)
        return info

    return finish_writing


def finish(info: dict[str, Any], status: str) -> dict[str, Any]:
    """provenance.json's content at the end of a run (the runner writes it beside result.json).

    Args:
        info: the record ``start``'s function returned; updated in place.
        status: the run's final status (``completed``, ``failed``, ...).

    Returns:
        `info`, with ``ended`` (the time now) and ``status`` added.
    """
    info.update(ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"), status=status)
    return info
