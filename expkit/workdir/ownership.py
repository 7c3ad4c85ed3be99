"""One writer per work dir: ``<work dir>/.lock``.

A run, a sweep job or an evaluation owns its work dir while it runs. The lock file holds
the owner (host, PID, the process's start time, start date, command) and a heartbeat
refreshed every 30 s, and the owner holds an exclusive ``flock`` on it. The kernel drops the
flock when the owner dies, however it dies (SIGKILL included), so on one host a second
writer is refused exactly while the owner lives; NFS clients honour flock across hosts too.
An owner on this host whose lock can be taken is gone, whatever its PID says: a killed
process that is not reaped yet (a zombie) still answers ``kill(pid, 0)``, and a PID is
reused. Where locks are not honoured, the file decides: an owner on this host is alive while
its PID runs, not a zombie, with the same start time; an owner on another host, while its
heartbeat is younger than ``STALE_AFTER_S``. A stale lock is taken over, with a message. The file stays after the
run, marked released, so that nobody ever locks a file another process is about to unlink.

Under Slurm the record names the job and its restart count. A job that Slurm started again
(a requeue, a preemption, a failed node) finds its earlier attempt's lock, perhaps from another
node: that owner is waited for until its heartbeat is ``REQUEUED_STALE_S`` old, not
``STALE_AFTER_S``, and then taken over; one that still beats after that wait is alive (a node cut
off from slurmctld still runs), and the dir is refused as busy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from expkit.core.errors import ConfigError

__all__ = [
    "HEARTBEAT_S",
    "LOCK_FILE",
    "REQUEUED_STALE_S",
    "REQUEUE_WAIT_S",
    "STALE_AFTER_S",
    "WorkDirBusy",
    "WorkDirLock",
    "busy_message",
    "describe",
    "earlier_attempt",
    "live_owner",
    "why_stale",
]


log = logging.getLogger("expkit")

LOCK_FILE = ".lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # an owner on another host with a heartbeat this old is gone
# an earlier attempt of this Slurm job (requeued) with a heartbeat this old is gone: three missed beats
REQUEUED_STALE_S = 3 * HEARTBEAT_S
# how long a requeued attempt waits for its earlier attempt's lock: its heartbeat to go stale, and an NFS
# server to drop the flock of a failed node (its lease, 90 s by default)
REQUEUE_WAIT_S = REQUEUED_STALE_S + 2 * HEARTBEAT_S


_HELD: set[int] = set()  # the lock files this process holds open


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the lock files: the flock
    belongs to the owner alone, and is gone the moment the owner dies."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class WorkDirBusy(ConfigError):
    """The work dir is owned by a live process (exit 2: pick another dir, or wait).

    Args:
        message: the error's text (``busy_message``'s: who holds the dir and what to do).
        owner: the lock file's content, kept as ``owner`` (``{"unreadable": True}`` when it could not be read).
    """

    def __init__(self, message: str, owner: dict[str, Any]) -> None:
        super().__init__(message)
        self.owner = owner


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (field 3, the state, comes first);
    None where /proc has no such PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot; /proc/<pid>/stat field 22), which
    tells a live owner from a new process that got its PID; None where /proc has no such PID."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None  # field 22 is the 20th after the command name


def _alive_here(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    fields = _stat_fields(pid)
    if fields is None:  # (no /proc: the signal's answer is all there is)
        return True
    # a killed process its parent has not reaped yet (a zombie) still answers os.kill, with
    # its start time: it holds nothing, so it owns nothing
    if fields[0] in ("Z", "X"):
        return False
    return owner.get("start") in (None, fields[19])


def _read(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 1 << 16, 0)
        info = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return info if isinstance(info, dict) else {}


def describe(owner: dict[str, Any]) -> str:
    """The owner recorded in a lock file, in one line for a message.

    Args:
        owner: the lock file's content.

    Returns:
        Its PID, host, start date, heartbeat age and command (``?`` for what is missing).
    """
    age = time.time() - float(owner.get("heartbeat") or time.time())
    return (
        f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, since {owner.get('started', '?')}, "
        f"heartbeat {age:.0f} s ago: {owner.get('command', '?')}"
    )


def busy_message(work_dir: Path, owner: dict[str, Any]) -> str:
    """The message of WorkDirBusy: who holds `work_dir` and what the user can do.

    Args:
        work_dir: the work dir that is held.
        owner: the lock file's content (``{"unreadable": True}`` when it could not be read).

    Returns:
        The message; for an owner on another host, also when the dir becomes free if that host is gone.
    """
    who = describe(owner) if owner and not owner.get("unreadable") else "another process"
    elsewhere = ""
    if earlier := earlier_attempt(owner):
        elsewhere = (
            f" The owner is the earlier attempt of this job ({earlier}), and its heartbeat still changes: "
            "it runs on a node Slurm lost contact with, or has not ended yet. End its processes, then requeue."
        )
    elif owner.get("host") not in (None, socket.gethostname()) and owner.get("heartbeat"):
        free_at = time.strftime("%H:%M:%S", time.localtime(float(owner["heartbeat"]) + STALE_AFTER_S))
        elsewhere = (
            f" If that host is gone, the dir is free once the heartbeat is {STALE_AFTER_S:.0f} s old ({free_at})."
        )
    return (
        f"{work_dir} is in use by {who}. Wait for it to end, stop it, or give another dir "
        f"(hydra.run.dir=... / hydra.sweep.dir=...).{elsewhere}"
    )


def why_stale(
    owner: dict[str, Any],
    now: float | None = None,
    stale_after: float = STALE_AFTER_S,
    lock_free: bool = False,
) -> str | None:
    """Why the owner in a lock file no longer owns the dir, or None when it may still run.

    Args:
        owner: the lock file's content.
        now: the current time, seconds since the epoch; None: now.
        stale_after: the heartbeat age, in seconds, after which an owner on another host is gone.
        lock_free: the caller could flock the file: an owner on this host would hold that lock while
            it lives, so it is gone whatever its PID says (a PID can be a zombie's or reused).

    Returns:
        ``"released"`` for an empty or released lock; why the owner is gone (its PID no longer runs
        on this host, or its heartbeat is too old); None for an unreadable lock or an owner that may
        still run.
    """
    if not owner or owner.get("released"):
        return "released"
    if owner.get("unreadable"):
        return None
    if owner.get("host") == socket.gethostname():
        if not _alive_here(owner):
            return f"pid {owner.get('pid')} is no longer running"
        return f"pid {owner.get('pid')} no longer holds its lock" if lock_free else None
    age = (now or time.time()) - float(owner.get("heartbeat") or 0)
    if earlier := earlier_attempt(owner):
        return f"{earlier}, and its heartbeat is {age:.0f} s old" if age > min(stale_after, REQUEUED_STALE_S) else None
    return f"its heartbeat is {age:.0f} s old" if age > stale_after else None


def _slurm_attempt() -> tuple[str, int] | None:
    """(``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``) of this process; None outside Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    return (job, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)) if job else None


def earlier_attempt(owner: dict[str, Any]) -> str | None:
    """Whether the owner in a lock file is an earlier attempt of this very Slurm job: the same
    job id with a lower restart count (Slurm started the job again: requeue, preemption, a failed node).

    Args:
        owner: the lock file's content.

    Returns:
        ``"it is attempt N of Slurm job J, which is at attempt M now"``; None otherwise (also outside Slurm).
    """
    mine, restart = _slurm_attempt(), owner.get("slurm_restart")
    if mine is None or owner.get("slurm_job") != mine[0] or not isinstance(restart, int) or restart >= mine[1]:
        return None
    return f"it is attempt {restart} of Slurm job {mine[0]}, which is at attempt {mine[1]} now"


def _flock_exclusive(fd: int, stale_after: float, wait_s: float = 1.0) -> None:
    """An exclusive flock of `fd`, not waiting for an owner: a refused flock whose file records a
    live owner (by ``why_stale`` with the lock's `stale_after`) raises BlockingIOError at once.
    Otherwise the holder is a probe: ``live_owner`` takes a shared flock while it reads the
    record (microseconds here; longer over NFS or when the prober is descheduled on a loaded
    machine), and an owner starting then would be told the dir is busy; so the flock is tried
    again for up to `wait_s` seconds."""
    import fcntl

    deadline = time.monotonic() + wait_s
    pause = 0.002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            owner = _read(fd)
            if (owner and why_stale(owner, stale_after=stale_after) is None) or time.monotonic() >= deadline:
                raise  # (a live owner; or, past the wait, an owner that has not written its record yet)
            time.sleep(pause)
            pause = min(2 * pause, 0.1)


class WorkDirLock:
    """``with WorkDirLock(work_dir, command):`` owns the dir or raises WorkDirBusy.

    Args:
        work_dir: the dir to own; the lock file is ``<work_dir>/.lock`` (the dir is made when the lock is
            acquired, not here).
        command: the command recorded as the owner's; None: ``python`` and this process's ``sys.argv``.
        stale_after: the heartbeat age, in seconds, after which an owner on another host counts as gone
            (decides only where the filesystem does not honour flock).
        heartbeat: the seconds between refreshes of the lock file's heartbeat, in a background thread;
            <= 0: no thread (the heartbeat is written only when the lock is acquired and released).
        requeued_stale_after: the seconds an earlier attempt of this Slurm job must leave its record
            unchanged, watched on this machine's clock, before it is taken over.
        requeue_wait: the seconds ``acquire`` waits for an earlier attempt of this Slurm job before it
            refuses the dir as busy.
    """

    def __init__(
        self,
        work_dir: Path,
        command: str | None = None,
        stale_after: float = STALE_AFTER_S,
        heartbeat: float = HEARTBEAT_S,
        requeued_stale_after: float = REQUEUED_STALE_S,
        requeue_wait: float = REQUEUE_WAIT_S,
    ) -> None:
        self.path = Path(work_dir) / LOCK_FILE
        self.command = command or " ".join(["python", *sys.argv])
        self.stale_after, self.heartbeat = stale_after, heartbeat
        self.requeued_stale_after, self.requeue_wait = requeued_stale_after, requeue_wait
        self.fd: int | None = None
        self.took_over: str | None = None  # whose lock this one replaced, and why
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._info: dict[str, Any] = {}

    def acquire(self) -> WorkDirLock:
        deadline, seen, gone = None, None, None  # seen: (the earlier attempt's heartbeat, since when)
        while True:
            try:
                return self._acquire((seen[0], gone) if seen is not None and gone else None)
            except WorkDirBusy as busy:
                if earlier_attempt(busy.owner) is None:
                    raise
                # Slurm started this job again while its earlier attempt's heartbeat is recent: that
                # attempt is ending (KillWait), or was on a node that failed. Its record is watched on
                # this machine's clock (no other host's clock, no write-back delay counts): unchanged
                # for requeued_stale_after, its beat has stopped and it is taken over
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.requeue_wait
                    log.warning(
                        "Work dir %s is held by the earlier attempt of this Slurm job (%s): waiting up to %.0f s "
                        "for it to end",
                        self.path.parent,
                        describe(busy.owner),
                        self.requeue_wait,
                    )
                beat = busy.owner.get("heartbeat")
                if seen is None or seen[0] != beat:
                    seen, gone = (beat, now), None
                elif gone is None and now - seen[1] >= self.requeued_stale_after:
                    gone = f"{earlier_attempt(busy.owner)}, and its heartbeat has not changed for {now - seen[1]:.0f} s"
                    continue
                if now >= deadline:
                    raise
                time.sleep(min(deadline - now, 1.0))

    def _acquire(self, silent: tuple[Any, str] | None = None) -> WorkDirLock:
        """One try; `silent`: (a heartbeat, why it is gone): an owner whose record still shows that
        heartbeat is taken over (``acquire``'s watch of an earlier attempt), when its flock is free."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = True
            try:
                _flock_exclusive(fd, self.stale_after)
            except BlockingIOError:  # a live process holds it
                raise self._busy(_read(fd)) from None
            except OSError:  # a filesystem without locks: the file alone decides
                locked = False
            owner = _read(fd)
            reason = why_stale(owner, stale_after=self.stale_after, lock_free=locked) if owner else "released"
            if reason is None and silent is not None and owner.get("heartbeat") == silent[0]:
                reason = silent[1]
            if reason is None:
                raise self._busy(owner)
            if owner and reason != "released":
                self.took_over = f"{describe(owner)} ({reason})"
                log.warning("Work dir %s: taking it over from %s", self.path.parent, self.took_over)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _process_start(os.getpid()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": self.command,
        }
        if (attempt := _slurm_attempt()) is not None:  # (a requeued attempt knows its predecessor by these)
            self._info |= {"slurm_job": attempt[0], "slurm_restart": attempt[1]}
        try:
            self._write(heartbeat=time.time())
        except OSError:  # a full disk: the dir is not ours after all
            self.fd = None
            os.close(fd)
            raise
        _HELD.add(fd)
        if self.heartbeat > 0:
            self._thread = threading.Thread(target=self._beat, name="expkit-lock-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _busy(self, owner: dict[str, Any]) -> WorkDirBusy:
        return WorkDirBusy(busy_message(self.path.parent, owner), owner)

    def _write(self, **fields: Any) -> None:
        assert self.fd is not None
        self._info.update(fields)
        data = (json.dumps(self._info) + "\n").encode()
        os.pwrite(self.fd, data, 0)  # in place: the flock is on this inode
        os.ftruncate(self.fd, len(data))

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            with contextlib.suppress(OSError):  # a full disk must not end the run
                self._write(heartbeat=time.time())
                os.fsync(self.fd)  # type: ignore[arg-type]  # (on NFS: seen by another host now, not at write-back)

    def release(self) -> None:
        if self.fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            self._write(heartbeat=time.time(), released=True)
        _HELD.discard(self.fd)
        os.close(self.fd)  # drops the flock
        self.fd = None

    def __enter__(self) -> WorkDirLock:  # noqa: PYI034 - Self needs Python 3.11
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def live_owner(work_dir: Path) -> dict[str, Any] | None:
    """The live owner of `work_dir`, if any, without taking the lock from anyone.

    Args:
        work_dir: the work dir.

    Returns:
        The owner's record (``{"unreadable": True}`` when a holder's record cannot be read) while a
        process holds the lock, or, where locks are not honoured, while the record is not stale; None
        when there is no lock file or no live owner.
    """
    path = Path(work_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        import fcntl

        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd) or {"unreadable": True}
        except OSError:
            locked = False
        owner = _read(fd)
        return owner if owner and why_stale(owner, lock_free=locked) is None else None
    finally:
        os.close(fd)  # drops the probe's shared lock
