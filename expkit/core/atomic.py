"""Atomic file writes: a reader, or a resume after a kill at any moment, sees the old file or
the new one, never half of one.

A file is written under ``.<name>.tmp<pid>`` in the same directory, then renamed. With
``durable`` the data is also fsynced before the rename (power-loss safety, about 2.5 ms a
save on this machine's disk). Checkpoints, JSON records, the SVG curves and the
``last_checkpoint`` pointer are all written through here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["SpaceReserve", "disk_full", "save_atomic", "write_bytes_atomic", "write_json_atomic", "write_text_atomic"]


PathT = TypeVar("PathT", str, Path)


def disk_full(exc: BaseException) -> bool:
    """ENOSPC, however it surfaced (an OSError, or torch's zip writer's RuntimeError).

    Args:
        exc: the exception a write raised.

    Returns:
        True when `exc` has errno ENOSPC or its message reads like a full disk (torch's zip writer
        says "unexpected pos").
    """
    return getattr(exc, "errno", None) == errno.ENOSPC or "unexpected pos" in str(exc) or "No space left" in str(exc)


def _write_atomic(path: PathT, write: Callable[[int], None], durable: bool) -> PathT:
    """Write through `.<name>.tmp<pid>` then rename, in plain system calls (Python's file
    object around a small write cost about 20 us). `write` gets the temporary file's
    descriptor (the file exists, empty). Its directory is made when missing (not a
    mkdir call on every write). `durable` also fsyncs the data before the rename (about a
    millisecond), so that after a power cut the name holds the whole file. A failing close
    fails the write (NFS reports some write errors there), unless the write failed first."""
    name = os.fspath(path)
    head = os.path.dirname(name)
    tmp = _temporary(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileNotFoundError:
            os.makedirs(head or ".", exist_ok=True)
            fd = os.open(tmp, flags, 0o666)
        try:
            write(fd)
            if durable:
                os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):  # (the write's error is the one to report)
                os.close(fd)
            raise
        os.close(fd)
        os.replace(tmp, name)  # atomic: readers see the old file or the new one, never half
    except BaseException:
        with contextlib.suppress(OSError):  # never mask the write error with a cleanup error
            os.unlink(tmp)
        raise
    return path


class _RecordingFile:
    """The temporary file as torch.save writes it, keeping the OSError a write raised: torch's
    zip writer reports it as a RuntimeError of its own ("unexpected pos ..."), which reads the
    same for a full disk, a quota and an I/O error."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _temporary(name: str) -> str:
    """The temporary name `name` is written under: ``.<name>.tmp<pid>`` in its directory."""
    head, tail = os.path.split(name)
    return os.path.join(head, f".{tail}.tmp{os.getpid()}")


def _zip_ends(name: str) -> bool:
    """Whether the file ends with a zip end-of-central-directory record (torch writes no comment
    after it): one read of 4 bytes, about 2 us."""
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    try:
        size = os.fstat(fd).st_size
        if size < 22:
            return False
        os.lseek(fd, size - 22, os.SEEK_SET)
        return os.read(fd, 4) == b"PK\x05\x06"
    finally:
        os.close(fd)


def _torch_save(torch: Any, obj: Any, name: str) -> None:
    """torch.save to the file `name`; its directory is made when missing (the first save into a
    run's checkpoints/), then torch saves again. torch reports a missing directory as a RuntimeError
    without an errno, and it opens the file before pickling: the failed try pickles nothing."""
    try:
        torch.save(obj, name)
    except Exception:
        head = os.path.dirname(name)
        if os.path.isdir(head or "."):
            raise
        os.makedirs(head, exist_ok=True)
        torch.save(obj, name)


def _save_by_name(torch: Any, obj: Any, path: Path) -> bool:
    """torch.save to the temporary file by its name, then rename: torch's own C++ writer, no
    Python call per zip record (a Python file gets about a hundred writes a checkpoint: 0.1 ms
    of a 0.7 ms save of a small model). Returns False when the save failed or the file lacks its
    zip end record (a failed last write, which torch does not check), having removed the
    temporary file: its RuntimeError names no errno, so the caller writes again through a Python
    file, whose failure raises the file's own OSError (ENOSPC, EFBIG, EIO). A failed rename raises.
    A missing directory is made."""
    name = os.fspath(path)
    tmp = _temporary(name)
    renamed = False
    try:
        try:
            _torch_save(torch, obj, tmp)
            # torch's writer checks every write but not the close, which writes out the last buffer
            # (the zip's central directory and end record): a disk that fills there leaves a file
            # without its end record, and torch.save returns. The end record is the last 22 bytes.
            complete = _zip_ends(tmp)
        except Exception:
            return False  # (a KeyboardInterrupt, a SystemExit: raised, not written again)
        if complete:
            os.replace(tmp, name)
            renamed = True
        return renamed
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def save_atomic(obj: Any, path: Path, durable: bool = False) -> Path:
    """torch.save to `path` through a temporary file; returns `path`. A write that fails
    raises the file's own OSError (ENOSPC, EDQUOT, EIO by its errno).

    Args:
        obj: what to save with ``torch.save``.
        path: the file to write; its directory is made when missing.
        durable: fsync the data before the rename, so that it survives a power cut.

    Returns:
        `path`.

    Raises:
        OSError: the write's own error, also when torch's zip writer reported it as a RuntimeError.
    """

    import torch  # (here, not at the top: the JSON and text writes, and so a command's --help, need no torch)

    if not durable and _save_by_name(torch, obj, path):
        return path

    def write(fd: int) -> None:
        with os.fdopen(fd, "wb", closefd=False) as f:  # (flushed when it closes, before any fsync)
            out = _RecordingFile(f)
            try:
                torch.save(obj, out)
            except RuntimeError:
                if out.error is not None:
                    raise out.error from None
                raise

    return _write_atomic(path, write, durable=durable)


def write_bytes_atomic(path: PathT, data: bytes, durable: bool = False) -> PathT:
    """`data` to `path` through a temporary file (the pointer, JSON records, the SVG curves).

    Args:
        path: the file to write; its directory is made when missing.
        data: the file's whole content.
        durable: fsync the data before the rename, so that it survives a power cut.

    Returns:
        `path`.
    """

    def write(fd: int) -> None:
        view = memoryview(data)
        while view:  # (a regular file takes it in one call, short of a full disk or a signal)
            view = view[os.write(fd, view) :]

    return _write_atomic(path, write, durable=durable)


def write_text_atomic(path: PathT, text: str, durable: bool = False) -> PathT:
    """`text`, UTF-8 encoded, to `path` through a temporary file (``write_bytes_atomic``).

    Args:
        path: the file to write; its directory is made when missing.
        text: the file's whole content.
        durable: fsync the data before the rename, so that it survives a power cut.

    Returns:
        `path`.
    """
    return write_bytes_atomic(path, text.encode("utf-8"), durable=durable)


class SpaceReserve:
    """A few KiB held on the work dir's disk from the start of a run, given back when the disk
    is full so that the run's last words (result.json, provenance.json) still fit.

    Args:
        path: the file that holds the space (``SIZE`` bytes allocated now); deleted on release. When it
            cannot be made (a full disk already), nothing is held and no error is raised.
    """

    SIZE = 64 * 1024

    def __init__(self, path: Path) -> None:
        self.path: Path | None = path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:  # blocks allocated, nothing written (writing zeros and renaming cost 0.15 ms more)
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, self.SIZE)
                else:  # (macOS)
                    os.write(fd, bytes(self.SIZE))
            finally:
                os.close(fd)
        except OSError:  # already full at the start: nothing to hold
            self.release()

    def write_json(self, path: Path, obj: Any) -> Path:
        """write_json_atomic, retried with the reserve given back when the disk is full."""
        try:
            return write_json_atomic(path, obj)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self.release():
                raise
            return write_json_atomic(path, obj)

    def release(self) -> bool:
        """Give the space back; whether there was any."""
        if self.path is None:
            return False
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        self.path = None
        return True


def write_json_atomic(path: Path, obj: Any) -> Path:
    """`obj` as indented JSON (anything JSON cannot hold written as its ``str``), with a final newline,
    to `path` through a temporary file; not fsynced.

    Args:
        path: the file to write; its directory is made when missing.
        obj: the value to write.

    Returns:
        `path`.
    """
    return write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")
