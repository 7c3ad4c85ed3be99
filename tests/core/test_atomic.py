"""Atomic writes (expkit.core.atomic): readers see the old file or the new one, never half of one."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch
from conftest import small_disk

from expkit.core import atomic


@pytest.mark.parametrize("durable", [False, True])
def test_a_small_file_is_written_whole_into_a_directory_made_for_it(tmp_path, durable):
    target = tmp_path / "new" / "dir" / "last_checkpoint"
    assert atomic.write_text_atomic(target, "epoch_3.pth", durable=durable) == target
    assert target.read_text() == "epoch_3.pth"
    as_str = atomic.write_text_atomic(str(target), "epoch_4.pth")  # str in, str out (no Path built)
    assert as_str == str(target) and isinstance(as_str, str) and target.read_text() == "epoch_4.pth"
    big = bytes(range(256)) * 4096  # 1 MiB: written whole, whatever os.write takes per call
    atomic.write_bytes_atomic(target, big)
    assert target.read_bytes() == big
    assert sorted(p.name for p in target.parent.iterdir()) == ["last_checkpoint"]  # no temporary left


def test_a_write_that_fails_partway_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    atomic.write_json_atomic(target, {"status": "running"})
    before = target.read_bytes()
    real_write, calls = os.write, []

    def short_then_full(fd, data):  # the disk takes one byte a call, then is full
        calls.append(len(data))
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data[:1]))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(OSError) as raised:
        atomic.write_json_atomic(target, {"status": "completed", "pad": "x" * 100})
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC and len(calls) == 4 and calls[1] == calls[0] - 1  # short writes resumed
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_a_rename_that_fails_leaves_no_temporary(tmp_path):
    blocked = tmp_path / "result.json"
    (blocked / "inside").mkdir(parents=True)  # a directory under the name: the rename fails
    with pytest.raises(IsADirectoryError):
        atomic.write_json_atomic(blocked, {"status": "completed"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"] and blocked.is_dir()
    with pytest.raises(IsADirectoryError):
        atomic.save_atomic({"w": torch.ones(2)}, blocked)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_a_checkpoint_that_fills_the_disk_fails_with_enospc_and_leaves_the_old_one(tmp_path):
    """torch's zip writer turns the file's OSError into "unexpected pos ...": the file's own is raised."""
    with small_disk(tmp_path / "disk", "256k") as disk:
        target = disk / "epoch_1.pth"
        atomic.save_atomic({"w": torch.ones(10)}, target)
        with pytest.raises(OSError) as raised:
            atomic.save_atomic({"w": torch.ones(200_000)}, target)  # 800 KB
        assert raised.value.errno == errno.ENOSPC
        assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(10))
        assert sorted(p.name for p in disk.iterdir()) == ["epoch_1.pth"]  # no temporary left
        atomic.save_atomic({"w": torch.ones(1000)}, target, durable=True)
        assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(1000))


def test_a_close_that_fails_after_a_failed_write_keeps_the_write_error(tmp_path, monkeypatch):
    target = tmp_path / "result.json"

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def bad_close(fd, real_close=os.close):
        real_close(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "close", bad_close)
    with pytest.raises(OSError) as raised:
        atomic.write_json_atomic(target, {"status": "completed"})
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "close", bad_close)  # a close that fails after a good write fails the write
    with pytest.raises(OSError) as raised:
        atomic.write_json_atomic(target, {"status": "completed"})
    monkeypatch.undo()
    assert raised.value.errno == errno.EIO and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="POSIX file size limits")
def test_a_checkpoint_write_error_keeps_its_own_errno(tmp_path):
    """Not every failed write is a full disk: a file size limit fails with EFBIG, and the error
    says so (torch's RuntimeError read as a full disk before)."""
    import resource

    target = tmp_path / "epoch_1.pth"
    atomic.save_atomic({"w": torch.ones(10)}, target)
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))
    try:
        with pytest.raises(OSError) as raised:
            atomic.save_atomic({"w": torch.ones(200_000)}, target)  # 800 KB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert raised.value.errno == errno.EFBIG
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_1.pth"]


def test_an_object_torch_cannot_save_raises_its_error_and_leaves_no_temporary(tmp_path):
    """The save by the temporary file's name fails, then the save through a Python file fails the
    same way: the pickling error is raised, and neither attempt leaves a file."""
    target = tmp_path / "epoch_1.pth"
    with pytest.raises((AttributeError, TypeError, RuntimeError), match="pickle|lambda"):
        atomic.save_atomic({"w": torch.ones(2), "f": lambda: 0}, target)
    assert list(tmp_path.iterdir()) == []
    atomic.save_atomic({"w": torch.ones(2)}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_1.pth"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(2))


def test_a_checkpoint_whose_last_write_was_lost_is_written_again(tmp_path, monkeypatch):
    """torch's writer does not check the close that writes its last buffer (the zip's end): a
    file without its end record is never renamed into place; the save goes through the Python
    file instead, which checks every write."""
    real_save, by_name = torch.save, []

    def loses_the_tail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if isinstance(f, str):  # the save by name: its last 30 bytes never reached the disk
            by_name.append(f)
            os.truncate(f, os.path.getsize(f) - 30)

    monkeypatch.setattr(torch, "save", loses_the_tail)
    target = tmp_path / "epoch_1.pth"
    atomic.save_atomic({"w": torch.arange(1000.0)}, target)
    monkeypatch.undo()
    assert len(by_name) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["epoch_1.pth"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(1000.0))


def test_the_first_checkpoint_into_a_new_directory_is_saved_by_name(tmp_path, monkeypatch):
    """A run's first save goes to a checkpoints/ dir not made yet: the dir is made and torch
    writes the file by name, not through the Python file (which would pickle the object again)."""
    real_save, targets = torch.save, []

    def recording(obj, f, *args, **kwargs):
        targets.append("name" if isinstance(f, str) else "file")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", recording)
    target = tmp_path / "run" / "checkpoints" / "epoch_1.pth"
    atomic.save_atomic({"w": torch.arange(10.0)}, target)
    monkeypatch.undo()
    assert "file" not in targets and targets[-1] == "name"
    assert sorted(p.name for p in target.parent.iterdir()) == ["epoch_1.pth"]
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(10.0))
