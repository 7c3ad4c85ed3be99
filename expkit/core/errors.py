"""Errors meant for the user: printed as one clear message, no traceback wall."""

from __future__ import annotations

import contextlib
import difflib
import sys
from collections.abc import Iterable, Iterator

__all__ = [
    "CheckpointWriteError",
    "ConfigError",
    "ExpkitError",
    "HookError",
    "ResumeRefused",
    "TaskExit",
    "config_errors_exit_2",
    "counted",
    "exit_status",
    "suggest",
    "task_exits",
]


class ExpkitError(Exception):
    """A problem the user can fix; the message says what to type instead."""


class ConfigError(ExpkitError):
    """A config value or override is wrong. The message names the key."""


class ResumeRefused(ConfigError):
    """The checkpoint a run would start from does not fit it; found before anything was written,
    so the run dir it names is left exactly as it was."""


class HookError(ExpkitError):
    """A hook raised inside a stage, or is malformed. Names the hook and the stage.

    Args:
        hook_name: the name of the hook (its class name, as expkit raises it), kept as ``hook_name``.
        stage: the stage it raised at, or the name of its malformed method, kept as ``stage``.
        message: what went wrong; the error's text is ``in <hook_name>.<stage>: <message>``.
    """

    def __init__(self, hook_name: str, stage: str, message: str) -> None:
        self.hook_name = hook_name
        self.stage = stage
        super().__init__(f"in {hook_name}.{stage}: {message}")


class CheckpointWriteError(ExpkitError):
    """A checkpoint could not be written; the previous complete one is untouched."""


class TaskExit(SystemExit):
    """A command's own exit from inside its Hydra task function: its status is final (see
    ``exit_status``)."""


@contextlib.contextmanager
def task_exits() -> Iterator[None]:
    """Around a Hydra task function's body: a SystemExit raised in it leaves as a ``TaskExit``
    with the same status, told apart from Hydra's own exits before the task began.

    Yields:
        Nothing: the body runs inside.

    Raises:
        TaskExit: for any SystemExit the body raised, with its code.
    """
    try:
        yield
    except TaskExit:
        raise
    except SystemExit as exc:
        raise TaskExit(exc.code) from None


@contextlib.contextmanager
def config_errors_exit_2() -> Iterator[None]:
    """Around a command's task body (``task_exits`` included): a ConfigError leaves as its one
    ``Error:`` line on stderr and exit 2, a SystemExit as a ``TaskExit`` with its status.

    Yields:
        Nothing: the body runs inside.

    Raises:
        TaskExit: with status 2 for a ConfigError the body raised; with its own code for a SystemExit.
    """
    try:
        with task_exits():
            yield
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2) from None


def exit_status(exc: SystemExit) -> str | int | None:
    """The status a command exits with when its Hydra app raised `exc`.

    Args:
        exc: what the Hydra app (``hydra.main``'s function) raised.

    Returns:
        The task's own status for a ``TaskExit``; 2 for Hydra's own error before the task began
            (an unknown key, an override it cannot parse: status 1 in Hydra), the input being the
            user's to fix; otherwise `exc`'s code (``--help``, ``--cfg job``: 0).
    """
    if isinstance(exc, TaskExit):
        return exc.code
    return 2 if exc.code == 1 else exc.code


def counted(count: int, noun: str) -> str:
    """A count with its noun for messages and headings: ``1 run``, ``3 runs``, ``0 jobs``.

    Args:
        count: how many.
        noun: the noun in the singular; the plural adds an ``s``.

    Returns:
        The count and the noun.
    """
    return f"{count} {noun}{'' if count == 1 else 's'}"


def suggest(name: str, choices: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The choices nearest to a mistyped `name`, for "did you mean" (``resnet``: ``resnet18``,
    not the alphabetically first option), compared without case (``adamW``: ``adamw``).

    Args:
        name: what the user typed.
        choices: the valid names.
        n: at most this many.
        cutoff: the least similarity (difflib's ratio, 0 to 1) a choice needs: at 0.6 a name that
            resembles none gets no suggestion (``nonexistent`` is no misspelt ``perf_stats``).

    Returns:
        Up to `n` choices, the nearest first.
    """
    by_lower: dict[str, str] = {}
    for choice in sorted(set(choices)):
        by_lower.setdefault(choice.lower(), choice)
    return [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=cutoff)]
