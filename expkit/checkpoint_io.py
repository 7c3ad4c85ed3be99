"""Atomic checkpoint and text writes, and the `last_checkpoint` pointer.

A file is written under a temporary name in the same directory, flushed to disk,
then renamed: a reader (or a resume after a crash) sees the old file or the new one,
never half of one. The pointer moves only after the checkpoint it names is complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from expkit.errors import ConfigError

LAST_CHECKPOINT = "last_checkpoint"


def _replace_atomically(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def save_atomic(obj: Any, path: Path) -> Path:
    """torch.save to `path` through a temporary file; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        _replace_atomically(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _replace_atomically(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def point_last_checkpoint(checkpoint_dir: Path, checkpoint_path: Path) -> None:
    """Record `checkpoint_path` as the newest complete checkpoint."""
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


def load_checkpoint(path: str | Path, key: str = "load_from") -> dict[str, Any]:
    """Read a checkpoint written by expkit; `key` names the config key in errors."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={path}: no such checkpoint file. Give the path of a .pth file in a run's checkpoints/ dir.")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ConfigError(f"{key}={path}: not an expkit checkpoint (no 'state_dict' key).")
    return checkpoint
