"""The hook table: registration, order, per-stage dispatch, signature checks, instrumentation.

A ``Runner`` holds one ``HookTable``. Hooks are kept sorted by priority (ties in
registration order); for each stage the table keeps only the hooks that override it, so a
stage nobody uses costs one dictionary lookup and an empty loop. ``after_train_iter`` has two
call lists: every iteration's, and the logging steps' (those hooks and the ``log_steps_only``
ones, such as the timer and the logger), switched in by ``HookTable.log_step``. The instrumented variant
(profiler markers, per-hook and per-phase timing) is switched in only while asked for.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from expkit.core.errors import ConfigError, HookError
from expkit.core.stages import Stage, get_priority, priority_name
from expkit.hooks.base import Hook

__all__ = ["NULL", "PAYLOADS", "HookTable", "Phase", "call_hook", "check_hook_methods", "overrides", "raise_hook_error"]


_STAGE_NAMES = frozenset(s.value for s in Stage)
_AFTER_TRAIN_ITER = Stage.AFTER_TRAIN_ITER.value
# keyword payload of each stage, read off the base class signatures
PAYLOADS: dict[str, tuple[str, ...]] = {
    s.value: tuple(p for p in inspect.signature(getattr(Hook, s.value)).parameters if p not in ("self", "runner"))
    for s in Stage
}
NULL = contextlib.nullcontext()  # shared: entering it costs next to nothing


def overrides(hook: Hook, stage: str) -> bool:
    """Whether `hook`'s class overrides `stage` (only those are called there).

    Args:
        hook: the hook.
        stage: a stage name, e.g. ``after_train_iter``.

    Returns:
        True when the attribute `stage` of the hook's class is not ``Hook``'s own.
    """
    return getattr(type(hook), stage) is not getattr(Hook, stage)


def call_hook(runner: Any, stage: str, **payload: Any) -> None:
    """Run every hook registered at `stage`, in priority order; an error names the hook and
    the stage. ``Runner.call_hook`` is this function (instrumented runs use
    ``HookTable.call_instrumented``).

    Args:
        runner: the runner, passed to each hook; its ``hook_table`` gives the hooks.
        stage: the stage name.
        **payload: the stage's keyword arguments, passed to each hook.

    Raises:
        HookError: when a hook raises (a HookError as it is, anything else but a ConfigError wrapped).
        ConfigError: when a hook raises a ConfigError, its message prefixed with the hook and stage.
    """
    for class_name, _, method in runner.hook_table.dispatch[stage]:
        try:
            method(runner, **payload)
        except Exception as exc:
            raise_hook_error(class_name, stage, exc)


def raise_hook_error(class_name: str, stage: str, exc: Exception) -> NoReturn:
    """An exception from a hook, named: a HookError as it is, bad input found by a hook as a
    ConfigError (still the user's to fix), anything else as a HookError naming hook and stage.

    Args:
        class_name: the class name of the hook that raised.
        stage: the stage it was called at.
        exc: the exception it raised.

    Returns:
        Never: it always raises.

    Raises:
        HookError: `exc` itself when it is one, else one naming `class_name` and `stage` (for anything
            but a ConfigError), chained to `exc`.
        ConfigError: when `exc` is one: its message prefixed with ``in <class_name>.<stage>``.
    """
    if isinstance(exc, HookError):
        raise exc
    if isinstance(exc, ConfigError):
        raise ConfigError(f"in {class_name}.{stage}: {exc}") from exc
    raise HookError(class_name, stage, f"{type(exc).__name__}: {exc}") from exc


def _add_time(table: dict[Any, list[float]], key: Any, seconds: float) -> None:
    entry = table.get(key)
    if entry is None:
        table[key] = [seconds, 1]
    else:
        entry[0] += seconds
        entry[1] += 1


class Phase:
    """Times a loop phase into the table's ``phase_times`` and marks it for the profiler.

    Args:
        table: the hook table whose ``timing`` and ``markers`` (read on entering and leaving the phase)
            decide whether the phase is timed and marked, and whose ``phase_times`` gets the time.
        name: the phase's name (``data``, ``forward``, ...): its key in ``phase_times`` and its
            profiler marker, ``phase/<name>``.
    """

    __slots__ = ("discard", "marker", "name", "start", "table")

    def __init__(self, table: HookTable, name: str) -> None:
        self.table, self.name, self.discard = table, name, False

    def __enter__(self) -> Phase:  # noqa: PYI034 - Self needs Python 3.11
        self.marker = torch.profiler.record_function(f"phase/{self.name}") if self.table.markers else None
        if self.marker is not None:
            self.marker.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        if self.table.timing and not self.discard:
            _add_time(self.table.phase_times, self.name, elapsed)
        if self.marker is not None:
            self.marker.__exit__(*exc)


class _LogStep:
    """``with table.log_step:`` around the loop's after_train_iter call at a logging step: the
    stage's dispatch is the logging steps' list inside (a class, not a generator: entered 80 times
    in a 800-iteration run, cheaper). A hook muted meanwhile is respected on leaving."""

    __slots__ = ("table",)

    def __init__(self, table: HookTable) -> None:
        self.table = table

    def __enter__(self) -> None:
        self.table.dispatch[_AFTER_TRAIN_ITER] = self.table.train_iter_calls[1]

    def __exit__(self, *exc: object) -> None:
        self.table.dispatch[_AFTER_TRAIN_ITER] = self.table.train_iter_calls[0]


class HookTable:
    """The hooks of one run, sorted by priority, with a dispatch tuple per stage."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, int, Hook]] = []  # (name, priority, hook), in firing order
        self.dispatch: dict[str, tuple[tuple[str, str, Callable], ...]] = {}  # stage -> (class, name, method)
        self.idle: frozenset[str] = frozenset()  # the stages no hook overrides (the loop skips them)
        self._muted: set[tuple[int, str]] = set()  # (id(hook), stage): left out of the dispatch
        # after_train_iter's calls: (every iteration's, a logging step's); dispatch holds the first
        self.train_iter_calls: tuple[tuple[tuple[str, str, Callable], ...], ...] = ((), ())
        self.log_step = _LogStep(self)
        self.markers = self.timing = False
        self.hook_times: dict[tuple[str, str], list[float]] = {}  # (stage, hook) -> [seconds, calls], when timing
        self.phase_times: dict[str, list[float]] = {}  # loop phase -> [seconds, calls], when timing
        self._rebuild()

    @property
    def hooks(self) -> list[Hook]:
        return [hook for _, _, hook in self.entries]

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.entries]

    @property
    def instrumented(self) -> bool:
        return self.markers or self.timing

    def register(self, hook: Hook, name: str | None = None, priority: int | str | None = None) -> str:
        """Add `hook` (`priority` beats its own ``priority`` attribute); returns the name it got:
        a second hook of the same name becomes ``Name_2``, ``Name_3``, ..."""
        if not isinstance(hook, Hook):
            raise TypeError(f"hook {name or hook!r} must be an instance of expkit.Hook, got {type(hook).__name__}")
        name = name or type(hook).__name__
        taken, base, k = set(self.names), name, 2
        while name in taken:
            name, k = f"{base}_{k}", k + 1
        check_hook_methods(hook)
        try:
            value = get_priority(priority if priority is not None else hook.priority)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"hook {name} ({type(hook).__name__}): {exc}") from None
        # insert after the last hook with priority <= value: ties keep registration order
        index = len(self.entries)
        while index > 0 and self.entries[index - 1][1] > value:
            index -= 1
        self.entries.insert(index, (name, value, hook))
        self._rebuild()
        return name

    def mute(self, hook: Hook, stage: str) -> None:
        """Call `hook` no more at `stage`: for a hook whose settings make that method a no-op
        (a per-epoch checkpoint at every iteration), so the loop does not call it for nothing."""
        self._muted.add((id(hook), Stage(stage).value))
        self._rebuild()

    def _rebuild(self) -> None:
        """For each stage, the hooks that override it, in order. Unused stages cost nothing."""
        calls = {
            stage.value: [
                (hook, (type(hook).__name__, name, getattr(hook, stage.value)))
                for name, _, hook in self.entries
                if overrides(hook, stage.value) and (id(hook), stage.value) not in self._muted
            ]
            for stage in Stage
        }
        iters = calls[_AFTER_TRAIN_ITER]
        self.train_iter_calls = (
            tuple(call for hook, call in iters if not hook.log_steps_only),
            tuple(call for _, call in iters),
        )
        self.dispatch = {stage: tuple(call for _, call in entries) for stage, entries in calls.items()}
        self.dispatch[_AFTER_TRAIN_ITER] = self.train_iter_calls[0]
        self.idle = frozenset(stage for stage, calls in self.dispatch.items() if not calls)  # no hook there

    def log_interval(self) -> int:
        """The iterations between logging steps within an epoch: the gcd of the hooks'
        ``log_step_interval`` (so each logger's own steps are among them); 1 when only
        ``log_steps_only`` hooks without one listen (every iteration is a logging step); 0 when no
        hook reads ``runner.train_window`` (the loop keeps no losses for it)."""
        hooks = [hook for _, _, hook in self.entries]
        intervals = [
            h.log_step_interval for h in hooks if isinstance(h.log_step_interval, int) and h.log_step_interval > 0
        ]
        if intervals:
            return math.gcd(*intervals)
        every, at_log = self.train_iter_calls
        return 1 if len(at_log) > len(every) else 0

    def call_instrumented(self, runner: Any, stage: str, payload: dict[str, Any]) -> None:
        """Like ``Runner.call_hook``, with a profiler marker per stage and hook call (``markers``)
        and the seconds of every hook at every stage added up in ``hook_times`` (``timing``)."""
        markers = self.markers
        with torch.profiler.record_function(f"stage/{stage}") if markers else NULL:
            for class_name, name, method in self.dispatch[stage]:
                start = time.perf_counter()
                try:
                    with torch.profiler.record_function(f"{class_name}.{stage}") if markers else NULL:
                        method(runner, **payload)
                except Exception as exc:
                    raise_hook_error(class_name, stage, exc)
                finally:
                    if self.timing:
                        _add_time(self.hook_times, (stage, name), time.perf_counter() - start)

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A loop phase (data, forward, backward, optimizer): marked and timed when instrumented."""
        return Phase(self, name) if self.instrumented else NULL

    def order_table(self) -> str:
        """The resolved order per stage, as printed at start-up."""
        lines = ["Hooks, in the order they run at each stage:"]
        for stage in Stage:
            entries = [
                f"({priority_name(p):<12}) {type(h).__name__} [{n}]"
                + (" (logging steps only)" if h.log_steps_only and stage is Stage.AFTER_TRAIN_ITER else "")
                for n, p, h in self.entries
                if overrides(h, stage.value)
            ]
            if entries:
                lines.append(f"{stage.value}:")
                lines.extend(f"    {e}" for e in entries)
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        """Each hook's own state, by name (hooks without state are left out)."""
        return {name: state for name, _, hook in self.entries if (state := hook.state_dict())}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for name, _, hook in self.entries:
            if name in states:
                hook.load_state_dict(states[name])


def check_hook_methods(hook: Hook) -> None:
    """Reject a misspelt stage (`after_train_itr`) or a stage method with a wrong signature.

    Args:
        hook: the hook to check; the public methods its classes define below ``Hook`` are checked.

    Raises:
        HookError: when a stage method does not take the stage's keyword payload, or a public method
            named ``before_*``, ``after_*`` or ``on_*`` is not a stage.
    """
    for cls in type(hook).__mro__:
        if cls is Hook or cls is object:
            break
        for attr, value in vars(cls).items():
            if not callable(value) or attr.startswith("_"):
                continue
            if attr in _STAGE_NAMES:
                try:
                    inspect.signature(getattr(hook, attr)).bind(None, **{k: None for k in PAYLOADS[attr]})
                except TypeError:
                    expected = ", ".join(["runner", *(f"{k}=..." for k in PAYLOADS[attr])])
                    raise HookError(
                        type(hook).__name__, attr, f"wrong signature; the stage passes ({expected}) by keyword"
                    ) from None
            elif attr.startswith(("before_", "after_", "on_")):
                close = difflib.get_close_matches(attr, _STAGE_NAMES, n=1)
                hint = f"did you mean {close[0]}?" if close else f"stages are: {', '.join(s.value for s in Stage)}"
                raise HookError(type(hook).__name__, attr, f"{attr} is not a stage, so it would never run; {hint}")
