"""Errors meant for the user: printed as one clear message, no traceback wall."""

from __future__ import annotations

__all__ = ["CheckpointWriteError", "ConfigError", "ExpkitError", "HookError", "ResumeRefused"]


class ExpkitError(Exception):
    """A problem the user can fix; the message says what to type instead."""


class ConfigError(ExpkitError):
    """A config value or override is wrong. The message names the key."""


class ResumeRefused(ConfigError):
    """The checkpoint a run would start from does not fit it; found before anything was written,
    so the run dir it names is left exactly as it was."""


class HookError(ExpkitError):
    """A hook raised inside a stage, or is malformed. Names the hook and the stage."""

    def __init__(self, hook_name: str, stage: str, message: str) -> None:
        self.hook_name = hook_name
        self.stage = stage
        super().__init__(f"in {hook_name}.{stage}: {message}")


class CheckpointWriteError(ExpkitError):
    """A checkpoint could not be written; the previous complete one is untouched."""
