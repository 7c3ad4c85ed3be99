"""SIGTERM and SIGINT (preemption, Ctrl-C) as stop requests while a run runs."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def stop_on_signals(runner: Any) -> Iterator[None]:
    """Inside: SIGTERM / SIGINT become ``runner.request_stop``: the current iteration finishes,
    the checkpoint hook saves, result.json says stopped (``runner.stop_signal`` holds the
    signal). A second Ctrl-C interrupts at once. The previous handlers come back on exit.
    Outside the main thread (where Python cannot set handlers) it does nothing."""
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
