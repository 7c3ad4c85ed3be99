"""Checkpoint files on disk: the `last_checkpoint` pointer, finding, reading and removing.
A checkpoint is a ``.pth`` file or a sharded ``.dcp`` directory (``expkit.checkpoint.dcp``'s
format); this module reads both.

Writes go through ``expkit.core.atomic`` (temporary file, then rename), so the pointer moves
only after the checkpoint it names is complete, and a resume never reads half a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from expkit.checkpoint import dcp
from expkit.core.atomic import write_text_atomic
from expkit.core.confine import confined, inside
from expkit.core.errors import ConfigError

__all__ = [
    "LAST_CHECKPOINT",
    "find_last_checkpoint",
    "is_checkpoint",
    "load_checkpoint",
    "load_checkpoint_file",
    "load_resumable",
    "point_last_checkpoint",
    "read_consolidated",
    "read_sharded_state",
    "regular_checkpoints",
    "remove_checkpoint",
    "remove_stale_temporaries",
]


log = logging.getLogger("expkit")

LAST_CHECKPOINT = "last_checkpoint"


def point_last_checkpoint(checkpoint_dir: Path, checkpoint_path: Path, durable: bool = False) -> None:
    """Record `checkpoint_path` as the newest complete checkpoint, by its name relative to
    `checkpoint_dir` (a copied or moved run dir stays valid): written through a temporary
    file and renamed, so a reader never sees it half written. The old pointer is removed
    first: renaming over it makes ext4 flush the new file (``auto_da_alloc``), 0.3-0.5 ms a
    save here. For the moment in between (or after a kill there) a reader finds no pointer
    and takes the newest checkpoint file instead (``find_last_checkpoint``): the same one.

    Args:
        checkpoint_dir: the run's ``checkpoints`` directory, where the pointer file is written.
        checkpoint_path: the complete checkpoint (a file or a sharded directory) to point at; it must lie
            under `checkpoint_dir`.
        durable: fsync the pointer's data before the rename, so that it survives a power cut.
    """
    if checkpoint_path.parent == checkpoint_dir:  # as the checkpoint hook saves (resolving costs 50 us)
        target = checkpoint_path.name
    else:
        target = checkpoint_path.resolve().relative_to(checkpoint_dir.resolve()).as_posix()
    pointer = os.path.join(checkpoint_dir, LAST_CHECKPOINT)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pointer)
    write_text_atomic(pointer, target, durable=durable)


def find_last_checkpoint(work_dir: Path) -> Path | None:
    """The checkpoint `checkpoints/last_checkpoint` names; when there is no usable pointer
    (none yet, being replaced, unreadable, naming a file that is gone), the newest regular
    checkpoint; None when there is no checkpoint at all.

    Args:
        work_dir: the run directory (its ``checkpoints`` subdirectory is searched).

    Returns:
        The checkpoint's path, or None when there is none.
    """
    pointer = work_dir / "checkpoints" / LAST_CHECKPOINT
    recorded = ""
    if pointer.is_file():
        try:
            recorded = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("Ignoring %s, it is not a readable path (%s)", pointer, exc)
    if recorded:
        path = confined(pointer.parent, recorded, pointer, "checkpoint")
        if path is not None and is_checkpoint(path):
            return path
    return next(iter(regular_checkpoints(work_dir)), None)


def regular_checkpoints(work_dir: Path) -> list[Path]:
    """The regular (not best) checkpoints of `work_dir`, newest first.

    Args:
        work_dir: the run directory (its ``checkpoints`` subdirectory is searched).

    Returns:
        The ``.pth`` files and complete ``.dcp`` directories in ``checkpoints``, neither hidden nor
        named ``best_*`` nor leading out of it, sorted by modification time, newest first.
    """
    directory = work_dir / "checkpoints"
    found = [
        p
        for p in directory.glob("*")
        if p.suffix in (".pth", ".dcp")
        and not p.name.startswith(("best_", "."))
        and is_checkpoint(p)
        and inside(directory, p)
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file, or a complete sharded checkpoint directory.

    Args:
        path: the path to test.

    Returns:
        True for any regular file (its content is not checked) or a complete sharded checkpoint directory.
    """
    return path.is_file() or dcp.is_checkpoint_dir(path)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint, a file or a sharded directory (renamed first: a kill during the
    deletion leaves a temporary name, never a directory that looks complete without its shards).
    A symlink loses only itself; a directory is deleted only when it is a complete sharded
    checkpoint (``.dcp`` with its index), never any other tree.

    Args:
        path: the checkpoint file, symlink or sharded ``.dcp`` directory to delete; a missing file is no error.
    """
    try:  # (a file or a symlink, the usual case: one system call)
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except (IsADirectoryError, PermissionError):  # (a directory: EISDIR on Linux, EPERM on macOS)
        if not path.is_dir() or path.is_symlink():
            raise
    if path.suffix == dcp.SUFFIX and dcp.is_checkpoint_dir(path):
        doomed = path.with_name(f".{path.name}.del{os.getpid()}")
        with contextlib.suppress(OSError):
            os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    else:
        log.warning("Not deleting %s: a directory that is not a sharded checkpoint", path)


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Delete the temporary files (`.<name>.tmp<pid>`) and sharded checkpoint directories
    (`.<name>.dcp.tmp<pid>`, `...tmp<pid>old`) a killed writer left in `directory`.

    Args:
        directory: the checkpoint directory to clean.

    Returns:
        The names of the entries deleted (not those restored to their name).
    """
    removed = []
    # a complete sharded checkpoint caught between its two renames (saved again under the same
    # name): it takes its name back, the newer one first, instead of being deleted
    for tmp in sorted(directory.glob(".*.tmp*"), key=lambda p: p.name.endswith("old")):
        head, _, tail = tmp.name.rpartition(".tmp")
        if tmp.is_symlink():  # expkit writes none: never followed, never deleted
            continue
        if tmp.is_file() and tail.isdigit():
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp.name)
        elif tmp.is_dir() and tail.removesuffix("old").isdigit():
            final = directory / head.removeprefix(".")
            if not final.exists() and dcp.is_checkpoint_dir(tmp):
                os.replace(tmp, final)
                log.info("Restored %s from %s (a save under the same name was interrupted)", final.name, tmp.name)
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp.name)
    for doomed in directory.glob(".*.del*"):  # a deletion a kill interrupted
        if doomed.is_dir() and not doomed.is_symlink() and doomed.name.rpartition(".del")[2].isdigit():
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(doomed.name)
    return removed


def load_resumable(work_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of `work_dir` that loads: the pointer's, else the newest regular
    file that is readable (after a power cut an unsynced file may be empty). None when there
    is no checkpoint; ConfigError when there are some but none loads.

    Args:
        work_dir: the run directory whose ``checkpoints`` are tried.

    Returns:
        The path of the checkpoint that loaded and its content (a sharded one without its weights,
        see ``load_checkpoint(consolidate=False)``), or None when there is no checkpoint.

    Raises:
        ConfigError: when there are checkpoints but none loads.
    """
    candidates = []
    pointed = find_last_checkpoint(work_dir)
    if pointed is not None:
        candidates.append(pointed)
    candidates += regular_checkpoints(work_dir)
    problems = []
    for path in dict.fromkeys(candidates):
        try:
            return path, load_checkpoint(path, "resume", consolidate=False)
        except ConfigError as exc:  # truncated or foreign: fall back to an older one, and say so
            log.warning("Cannot resume from this checkpoint, falling back to an older one: %s", exc)
            problems.append(path.name)
    if problems:
        raise ConfigError(
            f"resume=true: {work_dir / 'checkpoints'} holds checkpoints but none loads ({', '.join(problems)}; "
            "the reasons are above). Nothing was changed. To train this run again from scratch, run without "
            "resume=true (its checkpoints will be overwritten), or give another hydra.run.dir."
        )
    return None


def load_checkpoint(path: str | Path, key: str = "load_from", consolidate: bool = True) -> dict[str, Any]:
    """Read a checkpoint written by expkit, a file or a sharded directory; `key` names the
    config key in errors.

    Loads with ``weights_only=True``: tensors and plain containers only. A file that needs
    arbitrary unpickling is refused, never executed. A sharded checkpoint comes back with the
    whole model's weights as ``state_dict`` (no optimizer state); with ``consolidate=False``
    without them (``checkpoint["sharded"]["path"]`` says where they are, for
    ``expkit.checkpoint.dcp.load_into``).

    Args:
        path: a checkpoint file, or a sharded checkpoint directory (``.dcp``).
        key: the config key that gave `path`, named in error messages.
        consolidate: for a sharded checkpoint, read the model's weights into ``state_dict``; False
            reads only the rest.

    Returns:
        The checkpoint's content.

    Raises:
        ConfigError: when `path` is missing, unreadable, holds more than tensors and plain containers,
            or is not an expkit checkpoint.
    """
    path = Path(path)
    if path.is_dir() and path.suffix == dcp.SUFFIX:
        return read_consolidated(path, key) if consolidate else read_sharded_state(path, key)
    return load_checkpoint_file(path, key)


def load_checkpoint_file(path: Path, key: str, need_weights: bool = True) -> dict[str, Any]:
    """A checkpoint file, loaded with ``weights_only=True``; `need_weights`: it must hold a ``state_dict``.

    Args:
        path: the checkpoint file.
        key: the config key that gave `path`, named in error messages.
        need_weights: require a ``state_dict`` key.

    Returns:
        The checkpoint's content, loaded onto the CPU.

    Raises:
        ConfigError: when `path` is not a file, is unreadable or truncated, holds pickled objects beyond
            tensors and plain containers, is not a dict, or lacks ``state_dict`` while `need_weights`.
    """
    if not path.is_file():
        if key == "resume" and (path / "checkpoints").is_dir():  # a run dir: the run itself is continued in place
            raise ConfigError(
                f"resume={path}: that is a run dir, not a checkpoint file. To continue that run in its own dir: "
                f"hydra.run.dir={path} resume=true; to start a new run from its last checkpoint: "
                f"resume={path / 'checkpoints' / 'epoch_N.pth'} (a file there)"
            )
        raise ConfigError(
            f"{key}={path}: no such checkpoint file. Give the path of a .pth file (or a sharded "
            ".dcp directory) in a run's checkpoints/ dir."
        )
    try:
        with path.open("rb") as f:
            head = f.read(512)
    except OSError as exc:  # (a stale NFS handle, a file gone since: read as a checkpoint that cannot be)
        raise ConfigError(f"{key}={path}: unreadable checkpoint ({exc.strerror or exc})") from None
    if head and not head.startswith((b"PK\x03\x04", b"\x80")) and _is_text(head):  # (zip; legacy pickle)
        raise ConfigError(
            f"{key}={path}: not a checkpoint: torch.save writes a zip archive, and this file is text. Give "
            "a .pth file from a run's checkpoints/ dir (or a sharded .dcp directory)."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = str(exc).strip().splitlines()
        # torch's message: what was refused ("WeightsUnpickler error: Unsupported global: ..."), then advice
        first = next((line for line in lines if "Unpickler error" in line), lines[0] if lines else "").strip()
        raise ConfigError(
            f"{key}={path}: refused, the file holds pickled Python objects beyond tensors and plain "
            f"containers, and loading it would run arbitrary code ({first[:200]}). Re-save only its weights."
        ) from None
    except Exception as exc:  # truncated zip, garbage bytes, ...
        raise ConfigError(f"{key}={path}: unreadable or truncated checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(checkpoint, dict) or (need_weights and "state_dict" not in checkpoint):
        raise ConfigError(f"{key}={path}: not an expkit checkpoint (no 'state_dict' key).")
    return checkpoint


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes read as text (UTF-8, no control characters but whitespace)."""
    text = head.decode("utf-8", errors="ignore")  # (at most a character cut at the end is dropped)
    return len(text.encode()) >= len(head) - 3 and all(c.isprintable() or c in "\n\r\t" for c in text)


def read_sharded_state(path: Path, key: str) -> dict[str, Any]:
    """``state.pth`` of a sharded checkpoint (no weights), read as a checkpoint is.

    Args:
        path: the sharded checkpoint directory.
        key: the config key that gave `path`, named in error messages.

    Returns:
        The checkpoint without weights, its ``sharded`` entry with ``path`` (the directory, for
        ``expkit.checkpoint.dcp.load_into``) added.

    Raises:
        ConfigError: when `path` is not a complete sharded checkpoint, a shard is missing or truncated
            (``dcp.check_shards``), or ``state.pth`` does not load.
    """
    if not dcp.is_checkpoint_dir(path):
        raise ConfigError(
            f"{key}={path}: not a complete sharded checkpoint (a directory with .metadata and {dcp.STATE_FILE})"
        )
    dcp.check_shards(path, key)
    state = load_checkpoint_file(path / dcp.STATE_FILE, key, need_weights=False)
    state["sharded"] = dict(state.get("sharded") or {}, path=str(path))
    return state


def read_consolidated(path: Path, key: str) -> dict[str, Any]:
    """A sharded checkpoint as an ordinary one (``state_dict`` = the whole model's weights, no
    optimizer state), read in this process: for evaluation, export, ``load_from`` and the test.

    Args:
        path: the sharded checkpoint directory.
        key: the config key that gave `path`, named in error messages.

    Returns:
        The checkpoint, as ``read_sharded_state`` gives it, with ``state_dict`` (the weights) added.

    Raises:
        ConfigError: when `path` is not a complete sharded checkpoint, or a part of it is refused.
    """
    state = read_sharded_state(path, key)
    state["state_dict"] = dcp.read_weights(path)
    return state
