"""What produced a work dir: code version, environment, machine, command and time.

Written as ``provenance.json`` at the start of a run (and completed at its end), with
``provenance.diff`` when the git tree had uncommitted changes; result.json points to it.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from expkit.atomic import write_json_atomic, write_text_atomic


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(cwd: Path) -> dict[str, Any]:
    """Commit, branch and dirtiness of the repository that holds `cwd` (the user's project)."""
    heads = _git(["rev-parse", "HEAD", "--show-toplevel", "--abbrev-ref", "HEAD"], cwd)  # one process, not three
    lines = (heads or "").splitlines()
    if len(lines) != 3:
        return {"repository": None}
    commit, repository, branch = (line.strip() for line in lines)
    status = _git(["status", "--porcelain"], cwd) or ""
    return {
        "repository": repository,
        "commit": commit,
        "branch": branch,
        "dirty": bool(status.strip()),
        "changed_files": [line[3:] for line in status.splitlines()],
    }


def installed_packages() -> list[str]:
    """name==version of every installed distribution, from the ``*.dist-info`` folder names
    on sys.path (parsing each METADATA file instead takes about 0.1 s)."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = [n for n in os.listdir(entry or ".") if n.endswith(".dist-info")]
        except OSError:
            continue
        for name in names:
            package, _, version = name[: -len(".dist-info")].partition("-")
            found.setdefault(package.lower().replace("_", "-"), version)
    return sorted(f"{name}=={version}" for name, version in found.items())


def collect(cwd: Path | None = None) -> dict[str, Any]:
    cwd = cwd or Path.cwd()
    cuda = torch.cuda.is_available()
    return {
        "command": sys.argv,
        "cwd": str(cwd),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_state(cwd),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "packages": installed_packages(),
    }


def write(work_dir: Path, cwd: Path | None = None) -> dict[str, Any]:
    """provenance.json (and provenance.diff for a dirty tree) in `work_dir`."""
    info = collect(cwd)
    if info["git"].get("dirty"):
        diff = _git(["diff", "HEAD"], Path(info["cwd"])) or ""
        write_text_atomic(work_dir / "provenance.diff", diff)
        info["git"]["diff"] = "provenance.diff"
    write_json_atomic(work_dir / "provenance.json", info)
    return info


def finish(info: dict[str, Any], status: str) -> dict[str, Any]:
    """provenance.json's content at the end of a run (the runner writes it beside result.json)."""
    info.update(ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"), status=status)
    return info
