"""SIGTERM and SIGINT (preemption, Ctrl-C) as stop requests while a run runs."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["SweepInterrupted", "raise_on_sigterm", "stop_on_signals", "take_ctrl_c"]


class SweepInterrupted(BaseException):  # (a stop, as KeyboardInterrupt is, not an error)
    """A signal stopped a sweep: raised after the job it stopped has saved and recorded itself
    (or, with a launcher that runs jobs in workers, after the launch has returned), out of
    Hydra's launcher (which catches only Exception), so that no further job starts;
    ``expkit.train.main`` reports the sweep and exits 128 + `signum`.

    Args:
        signum: the number of the signal that stopped the sweep (also the exception's one argument).
        sweep_dir: the sweep's dir, whose jobs the report counts; None: the report looks for the dir of
            the last job that ran.
    """

    def __init__(self, signum: int, sweep_dir: Any = None) -> None:
        super().__init__(signum)
        self.signum, self.sweep_dir = signum, sweep_dir


@contextlib.contextmanager
def raise_on_sigterm() -> Iterator[None]:
    """Between a sweep's jobs (no run holds the signals): SIGTERM raises SweepInterrupted, as
    Ctrl-C raises KeyboardInterrupt, instead of ending the process unreported.

    Yields:
        None, with the SIGTERM handler in place (in the main thread only); the previous handler comes
        back on exit.

    Raises:
        SweepInterrupted: from inside the block, when SIGTERM arrives.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SweepInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stop_on_signals(runner: Any) -> Iterator[None]:
    """Inside: SIGTERM / SIGINT become ``runner.request_stop``: the current iteration finishes,
    the checkpoint hook saves, result.json says stopped (``runner.stop_signal`` holds the
    signal). A second Ctrl-C interrupts at once. The previous handlers come back on exit.
    Outside the main thread (where Python cannot set handlers) it does nothing.

    Args:
        runner: the runner to stop: its ``stop_signal`` is set and its ``request_stop`` called.

    Yields:
        None, with the handlers in place.

    Raises:
        KeyboardInterrupt: from inside the block, on a SIGINT after a first stop signal.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        if runner.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        runner.stop_signal = signum
        runner.request_stop(f"signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def take_ctrl_c() -> None:
    """Ctrl-C (SIGINT) stops an expkit command however it was started.

    A process started as a background job of a non-interactive shell (``cmd &`` in a script,
    ``setsid bash -c 'cmd' &``) inherits SIGINT ignored, and Python then leaves it ignored: a
    sweep started so ran every job to its end whatever ``kill -INT`` it was sent. That
    inheritance is POSIX's way of keeping a terminal's Ctrl-C from reaching background jobs,
    not a wish of the user's (a terminal sends Ctrl-C only to its foreground group anyway);
    whoever sends SIGINT to a run or a sweep wants it stopped, so expkit's commands take it
    back. SIGTERM was never affected. A process that must not be stopped by SIGINT runs in its
    own session (``setsid``), where no terminal's Ctrl-C reaches it.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
