"""SIGTERM and SIGINT (preemption, Ctrl-C) as stop requests while a run runs; the requeue
signals (``trainer.requeue_signal``, submitit's USR2) as stops the job comes back from."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "SweepInterrupted",
    "hand_over",
    "hold_sigterm",
    "quiet_ctrl_c",
    "raise_on_sigterm",
    "release_sigterm",
    "requeue_signals",
    "signal_number",
    "stop_for_signal",
    "stop_on_signals",
    "submitit_signal",
    "take_ctrl_c",
]


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


_HELD: list[int] = []  # a SIGTERM that came while a single run started (hold_sigterm), for the run to take


def _hold(signum: int, frame: Any) -> None:
    if not _HELD:  # (a repeat is the same request: slurmstepd and a launcher may both forward it)
        _HELD.append(signum)


def hold_sigterm() -> None:
    """Under Slurm, a SIGTERM that comes while a single run starts (imports, the process group, the
    model, the data, a resume) is kept, and the run takes it as its first stop request once its
    own handlers are in place (``stop_on_signals``): it stops before its first iteration, is recorded
    ``stopped``, and a preempted job requeues itself, as it would a moment later. Killed by the
    signal instead, a job preempted with a ``GraceTime`` ended before its grace time, and Slurm 22.05
    does not requeue such a job: it was lost. Slurm's SIGKILL after ``KillWait`` still ends a
    start-up that hangs. The run's end puts the default action back (``release_sigterm``). Outside
    Slurm, under torchrun (whose agent ends its workers with SIGTERM at a restart), under a
    handler of someone else's (submitit's), or outside the main thread, nothing changes.
    """
    if (
        "SLURM_JOB_ID" not in os.environ
        or "TORCHELASTIC_RESTART_COUNT" in os.environ
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # (an int 0 where it was restored as one)
    ):
        return
    signal.signal(signal.SIGTERM, _hold)


def release_sigterm() -> None:
    """SIGTERM's default action back where ``hold_sigterm`` held it, and nothing held any more."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _hold:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _HELD.clear()


def signal_number(name: str) -> int:
    """The number of the signal called `name`: ``USR1``, ``SIGUSR1`` or ``usr1``.

    Args:
        name: the signal's name, with or without ``SIG``.

    Returns:
        Its number on this platform.

    Raises:
        KeyError: no signal has that name.
    """
    return int(signal.Signals["SIG" + name.upper().removeprefix("SIG")])


def submitit_signal() -> int | None:
    """The signal submitit sends a job before its time limit, on which its own handler
    checkpoints the job, requeues it and exits: USR2, or what ``SUBMITIT_PREEMPT_SIGNAL`` names
    (submitit's ``JobEnvironment.USR_SIG`` reads the same variable).

    Returns:
        Its number inside a job started by submitit (``SUBMITIT_EXECUTOR`` is set); None elsewhere.
    """
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    return signal_number(os.environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2")


def requeue_signals(requeue_signal: str | None) -> tuple[int, ...]:
    """The signals on which a run saves and stops to be continued: `requeue_signal`, and inside a
    submitit job submitit's own (``submitit_signal``).

    Args:
        requeue_signal: ``trainer.requeue_signal`` (a name such as ``USR1``); None: none of its own.

    Returns:
        Their numbers, each once; empty when there are none (a signal this platform lacks is left out).
    """
    own = [signal_number(requeue_signal)] if requeue_signal and hasattr(signal, f"SIG{requeue_signal}") else []
    return tuple(dict.fromkeys([*own, *filter(None, [submitit_signal()])]))


def hand_over(signum: int) -> str | None:
    """Give submitit the signal expkit held back while the run saved: submitit's own handler
    (installed before the job started, back once the run ended) checkpoints the job, requeues
    it and ends this process, or says why it does not requeue (``max_num_timeout`` spent, a
    job that is not checkpointable). On ranks other than 0 it does nothing.

    Args:
        signum: submitit's signal (``submitit_signal``).

    Returns:
        None when the handler returned (on a rank other than 0); why submitit does not requeue
            the job otherwise.

    Raises:
        SystemExit: from submitit, once it has requeued the job.
    """
    if not callable(signal.getsignal(signum)):  # (no handler of submitit's: the signal would end the process)
        return f"no handler for {signal.Signals(signum).name} is installed"
    from submitit.core.utils import UncompletedJobError

    try:
        signal.raise_signal(signum)  # (its handler runs before raise_signal returns, in this thread)
    except UncompletedJobError as exc:
        return str(exc)
    return None


def stop_for_signal(runner: Any, signum: int, where: str = "") -> None:
    """Stop `runner` as `signum` asks: after the current iteration, ``runner.stop_signal`` set, the
    reason ``signal SIGTERM``; a requeue signal (in ``runner.requeue_signals``) stops it resumable
    and sets ``runner.requeue``, unless the run was already stopping for another reason. A
    requeue signal after SIGTERM (a job's time-limit signal while an admin's requeue, a preemption
    or a cancel stops it) leaves ``stop_signal`` at SIGTERM: whether Slurm starts the job again is
    then Slurm's to say, and the job stops alone, not its whole sweep.

    Args:
        runner: the runner to stop.
        signum: the signal.
        where: said after the reason (`` (on another rank)``: a signal only another rank had).
    """
    requeue = signum in getattr(runner, "requeue_signals", ()) and signum not in (signal.SIGTERM, signal.SIGINT)
    if requeue:
        runner.requeue = runner.requeue or runner.stop_reason is None
    if not (requeue and runner.stop_signal == signal.SIGTERM):  # (after SIGTERM, Slurm's answer decides)
        runner.stop_signal = signum
    runner.request_stop(f"signal {signal.Signals(signum).name}{where}", resumable=requeue)


@contextlib.contextmanager
def stop_on_signals(runner: Any) -> Iterator[None]:
    """Inside: SIGTERM / SIGINT become ``runner.request_stop``: the current iteration finishes,
    the checkpoint hook saves, result.json says stopped (``runner.stop_signal`` holds the
    signal). A second Ctrl-C interrupts at once. The runner's requeue signals
    (``runner.requeue_signals``) stop it the same way and set ``runner.requeue``: the command
    requeues the job once the run is recorded. The previous handlers come back on exit.
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
        stop_for_signal(runner, signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in getattr(runner, "requeue_signals", ()):
        if sig not in previous:  # (TERM or INT among them stays a plain stop)
            previous[sig] = signal.signal(sig, on_signal)
    while _HELD:  # a SIGTERM during the start-up (hold_sigterm): the first stop request
        stop_for_signal(runner, _HELD.pop(), " (during start-up)")
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is _hold else handler)  # (the start-up is over)


@contextlib.contextmanager
def quiet_ctrl_c(command: str, note: str = "", at_once: bool = False) -> Iterator[None]:
    """A Ctrl-C inside the block ends the command with exit 130 and one line instead of a
    KeyboardInterrupt's traceback (through the import machinery, when it lands in torch's
    second of importing): for a command's start, and for the commands that write nothing a Ctrl-C
    could leave half done. A run handles its own Ctrl-C (it saves and records itself).

    Args:
        command: the command's name, for the line (``expkit.eval``).
        note: what the line adds after "interrupted (SIGINT)", e.g. "while starting; nothing was written".
        at_once: the process ends in the signal's handler (``os._exit``), for a block that writes
            nothing: a KeyboardInterrupt raised inside an import can be swallowed by the library's own
            ``except BaseException`` (a Ctrl-C 0.7 s into train's start was lost, and the run trained to
            its end). Only where SIGINT has Python's default handler, in the main thread.

    Yields:
        Nothing: the block runs as it is.

    Raises:
        SystemExit: with status 130 after a KeyboardInterrupt inside the block, 128 + its signal after
            a ``SweepInterrupted`` (a sweep of the command stopped by Ctrl-C or SIGTERM).
    """

    def said(signum: int) -> str:
        return f"{command}: interrupted ({signal.Signals(signum).name}){'; ' + note if note else ''}"

    def leave(signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(said(signum), file=sys.stderr, flush=True)
        os._exit(128 + signum)

    main = threading.current_thread() is threading.main_thread()
    own = at_once and main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own:
        signal.signal(signal.SIGINT, leave)
    try:
        yield
    except (KeyboardInterrupt, SweepInterrupted) as exc:  # (an expkit sweeper's launch turns Ctrl-C into the latter)
        signum = exc.signum if isinstance(exc, SweepInterrupted) else signal.SIGINT
        with contextlib.suppress(OSError, ValueError):  # (a closed stderr: the exit status says it)
            print(said(signum), file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        if own:
            signal.signal(signal.SIGINT, signal.default_int_handler)


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
