"""expkit's log lines: their format, where they go, and a log that cannot be written.

``python -m expkit.train`` logs through Hydra's job logging (the same format, set in
``conf/*.yaml``) to the terminal and ``<work dir>/train.log``; torchrun's ranks > 0 to
``rank<N>.log`` (on the terminal, only their warnings and errors, marked ``[rank N]``); a Runner used from Python with logging unconfigured, to the terminal.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

__all__ = [
    "LOG_FORMAT",
    "HeldFileRecords",
    "errors_in_one_line",
    "log_to_file",
    "log_to_rank_file",
    "quiet_terminal",
    "show_progress",
    "terminal_shows",
]


log = logging.getLogger("expkit")
LOG_FORMAT = ("[%(asctime)s] %(message)s", "%H:%M:%S")  # (format, datefmt), as hydra.job_logging in conf/*.yaml


def show_progress() -> None:
    """From Python with logging unconfigured: expkit's lines still reach the terminal."""
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(*LOG_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def log_to_file(path: Path) -> None:
    """Also write every log record to `path` (a sweep job moved to another dir: its train.log).

    Args:
        path: the log file, opened for appending; a handler for it is added to the root logger.
    """
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(*LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    errors_in_one_line()


class HeldFileRecords:
    """From now on, the records meant for the log files (train.log) are held in memory; the
    terminal still shows them. ``keep()`` writes them and lets later ones through; ``release()``
    without a ``keep()`` drops them. A resume whose checkpoint is refused leaves the run's
    train.log exactly as it was, as the refusal says."""

    def __init__(self) -> None:
        from logging.handlers import MemoryHandler

        root = logging.getLogger()
        self._held: list[tuple[MemoryHandler, logging.Handler]] = []
        for handler in list(root.handlers):
            if isinstance(handler, logging.FileHandler):
                memory = MemoryHandler(1 << 30, flushLevel=logging.CRITICAL + 1, flushOnClose=False)
                root.removeHandler(handler)
                root.addHandler(memory)
                self._held.append((memory, handler))

    def keep(self) -> None:
        """Write the held records to their files; records go straight there from now on."""
        for memory, handler in self._held:
            memory.setTarget(handler)
            memory.flush()
        self.release()

    def release(self) -> None:
        """Put the files' handlers back (the records still held are dropped); safe to call twice."""
        root = logging.getLogger()
        for memory, handler in self._held:
            root.removeHandler(memory)
            memory.buffer.clear()
            root.addHandler(handler)
        self._held = []


def log_to_rank_file(work_dir: Path, rank: int) -> None:
    """Ranks > 0 keep their own log file (rank<N>.log, every record) instead of sharing
    train.log, and print only warnings and errors, prefixed with their rank: rank 0 tells the
    run once, and a line from another rank says whose it is.

    Args:
        work_dir: the run directory, where ``rank<N>.log`` is written.
        rank: this process's rank; nothing changes on rank 0.
    """
    if rank == 0:
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            replacement = logging.FileHandler(work_dir / f"rank{rank}.log")
            replacement.setFormatter(handler.formatter)
            root.addHandler(replacement)
            handler.close()
        elif isinstance(handler, logging.StreamHandler):  # the terminal
            handler.setLevel(max(handler.level, logging.WARNING))
            handler.setFormatter(logging.Formatter(LOG_FORMAT[0].replace("] ", f"] [rank {rank}] ", 1), LOG_FORMAT[1]))


def quiet_terminal() -> None:
    """A sweep job's terminal shows only its warnings and errors (its train.log keeps every
    line): the sweep prints one progress line per finished job instead."""
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # the terminal (a FileHandler is a subclass)
            handler.setLevel(max(handler.level, logging.WARNING))


def terminal_shows(logger: logging.Logger, level: int) -> bool:
    """Whether a record of `logger` at `level` reaches the terminal (a stream handler of the root
    logger's, as Hydra's job logging sets up; ``quiet_terminal`` raises its level in a sweep).

    Args:
        logger: the logger the record would go through.
        level: the record's level.

    Returns:
        True when a plain stream handler on the root logger would show it.
    """
    if not logger.isEnabledFor(level):
        return False
    return any(type(h) is logging.StreamHandler and level >= h.level for h in logging.getLogger().handlers)


def errors_in_one_line() -> None:
    """A log file that cannot be written (a full disk) is said once, in one line, instead of
    logging's "--- Logging error ---" traceback for every record after it; the same for a
    library's writer thread that cannot write."""

    def handle_error(handler: logging.FileHandler, record: logging.LogRecord) -> None:
        if not getattr(handler, "_expkit_failed", False):
            handler._expkit_failed = True  # type: ignore[attr-defined]
            exc = sys.exc_info()[1]
            cause = "no space left on the device" if getattr(exc, "errno", None) == 28 else exc
            print(
                f"expkit: could not write {handler.baseFilename}: {cause}; records are missing from it", file=sys.stderr
            )

    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not hasattr(handler, "_expkit_one_line"):
            handler._expkit_one_line = True  # type: ignore[attr-defined]
            handler.handleError = handle_error.__get__(handler)  # type: ignore[method-assign]

    def thread_error(args: threading.ExceptHookArgs) -> None:
        """A library's writer thread (TensorBoard's) that hits a full disk: one line, not a traceback."""
        if not isinstance(args.exc_value, OSError):
            return default_thread_error(args)
        tb, library = args.exc_traceback, "?"
        while tb is not None:
            library = str(tb.tb_frame.f_globals.get("__name__", "?")).partition(".")[0]
            tb = tb.tb_next
        name = args.thread.name if args.thread is not None else "a thread"
        print(f"expkit: {library}'s writer ({name}) stopped: {args.exc_value}", file=sys.stderr)

    default_thread_error = threading.excepthook
    if default_thread_error.__name__ != thread_error.__name__:  # once per process (sweep jobs share it)
        threading.excepthook = thread_error
