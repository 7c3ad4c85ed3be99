"""Atomic checkpoint and text writes, and the `last_checkpoint` pointer.

A file is written under a temporary name in the same directory, then renamed: a reader
(or a resume after a kill at any moment) sees the old file or the new one, never half of
one. With ``durable`` the data is also fsynced before the rename (power-loss safety, about
2.5 ms a save on this machine's disk). The pointer moves only after the checkpoint it
names is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from expkit.errors import ConfigError

log = logging.getLogger("expkit")

LAST_CHECKPOINT = "last_checkpoint"


def _write_atomic(path: Path, write: Callable[[IO[bytes]], None], durable: bool) -> Path:
    """Write through `.<name>.tmp<pid>` then rename. `durable` also fsyncs the data before the
    rename (about a millisecond), so that after a power cut the name holds the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half
    except BaseException:
        with contextlib.suppress(OSError):  # never mask the write error with a cleanup error
            tmp.unlink(missing_ok=True)
        raise
    return path


def save_atomic(obj: Any, path: Path, durable: bool = False) -> Path:
    """torch.save to `path` through a temporary file; returns `path`."""
    return _write_atomic(path, lambda f: torch.save(obj, f), durable=durable)


def write_bytes_atomic(path: Path, data: bytes, durable: bool = False) -> Path:
    return _write_atomic(path, lambda f: f.write(data), durable=durable)


def write_text_atomic(path: Path, text: str, durable: bool = False) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), durable=durable)


def write_json_atomic(path: Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def point_last_checkpoint(checkpoint_dir: Path, checkpoint_path: Path) -> None:
    """Record `checkpoint_path` as the newest complete checkpoint: written through a temporary
    file and renamed, so a reader (a monitor, a resume) never sees it empty or half written."""
    write_text_atomic(checkpoint_dir / LAST_CHECKPOINT, str(checkpoint_path.resolve()))


def find_last_checkpoint(work_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/last_checkpoint` names, or None when there is none."""
    pointer = work_dir / "checkpoints" / LAST_CHECKPOINT
    if not pointer.is_file():
        return None
    path = Path(pointer.read_text(encoding="utf-8").strip())
    if not path.is_absolute():
        path = work_dir / path
    return path if path.is_file() else None


def load_resumable(work_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `work_dir` that loads: the pointer's, else the newest regular
    file that is readable (after a power cut an unsynced file may be empty). None if none."""
    candidates = []
    pointed = find_last_checkpoint(work_dir)
    if pointed is not None:
        candidates.append(pointed)
    regular = [p for p in (work_dir / "checkpoints").glob("*.pth") if not p.name.startswith("best_")]
    candidates += sorted(regular, key=lambda p: p.stat().st_mtime, reverse=True)
    for path in dict.fromkeys(candidates):
        try:
            return path, load_checkpoint(path, "resume")
        except ConfigError as exc:  # truncated or foreign: fall back to an older one, and say so
            log.warning("Cannot resume from this checkpoint, falling back to an older one: %s", exc)
    return None


def load_checkpoint(path: str | Path, key: str = "load_from") -> dict[str, Any]:
    """Read a checkpoint written by expkit; `key` names the config key in errors.

    Loads with ``weights_only=True``: tensors and plain containers only. A file that needs
    arbitrary unpickling is refused, never executed.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={path}: no such checkpoint file. Give the path of a .pth file in a run's checkpoints/ dir.")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise ConfigError(
            f"{key}={path}: refused, the file holds pickled Python objects beyond tensors and plain "
            f"containers, and loading it would run arbitrary code ({first[:200]}). Re-save only its weights."
        ) from None
    except Exception as exc:  # truncated zip, garbage bytes, ...
        raise ConfigError(f"{key}={path}: unreadable or truncated checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"{key}={path}: not an expkit checkpoint (no 'state_dict' key).")
    return checkpoint
