"""The Hook base class: one no-op method per Stage, payloads as keyword arguments.

Override only the stages you need; the Runner calls a hook only at the stages it
overrides, so an unused stage costs nothing. Where each stage fires is ``expkit.core.stages``
(the loop as pseudocode); what holds at each one is the stage table in the docs' Hooks
page. ``outputs`` is the dict the step returned (``loss`` tensor, ``logits``, ...).
After ``runner.request_stop(reason)`` the current iteration finishes, then
after_train_epoch, after_train, the test (not after a SIGTERM/SIGINT) and after_run still
fire. After an exception: on_exception, then after_run, then the exception propagates.
after_run may run twice; make it idempotent. ``runner.load_purpose`` says why a
checkpoint was loaded (resume, load_from, test).

Interval checks, as MMEngine's hooks have them: ``every_n_train_iters``,
``every_n_epochs``, ``every_n_inner_iters``, ``end_of_epoch``, ``is_last_train_iter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from expkit.core.stages import Priority

if TYPE_CHECKING:
    from expkit.engine.runner import Runner


__all__ = ["Hook"]


class Hook:
    """Base class of every hook. Subclasses set ``priority`` and override stage methods."""

    priority: ClassVar[int | str | Priority] = Priority.NORMAL
    # False: the hook does not work with sharded (FSDP2, DTensor) parameters; a run with
    # trainer.strategy=fsdp refuses it at start-up instead of failing (or hanging) later
    supports_sharding: ClassVar[bool] = True
    # True: after_train_iter is called at logging steps only (every log_step_interval iterations of
    # the epoch, gcd of the hooks', each epoch's last iteration and the run's last), and
    # runner.train_window holds what the iterations in between left (losses, data time). For hooks
    # that summarise the interval, as the timer and the logger do: the other iterations call nothing.
    log_steps_only: ClassVar[bool] = False
    # the iterations between this hook's records (LoggerHook's interval): sets the logging steps
    log_step_interval: int | None = None

    # -- state: saved in every checkpoint under checkpoint["hooks"][name] --------------
    def state_dict(self) -> dict[str, Any]:
        """What this hook needs to continue after a resume; {} when stateless."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what state_dict returned."""

    # -- the stages ---------------------------------------------------------------------
    def before_run(self, runner: Runner) -> None: ...

    def after_load_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None: ...

    def before_train(self, runner: Runner) -> None: ...

    def before_train_epoch(self, runner: Runner) -> None: ...

    def before_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any) -> None: ...

    def after_forward(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None: ...

    def after_backward(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None: ...

    def after_optimizer_step(
        self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]
    ) -> None: ...

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None: ...

    def after_train_epoch(self, runner: Runner) -> None: ...

    def before_val(self, runner: Runner) -> None: ...

    def before_val_epoch(self, runner: Runner) -> None: ...

    def before_val_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any) -> None: ...

    def after_val_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None: ...

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None: ...

    def after_val(self, runner: Runner) -> None: ...

    def before_save_checkpoint(self, runner: Runner, *, checkpoint: dict[str, Any]) -> None: ...

    def after_save_checkpoint(self, runner: Runner, *, path: Path, is_best: bool, metric: str | None) -> None: ...

    def after_train(self, runner: Runner) -> None: ...

    def before_test(self, runner: Runner) -> None: ...

    def before_test_epoch(self, runner: Runner) -> None: ...

    def before_test_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any) -> None: ...

    def after_test_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None: ...

    def after_test_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None: ...

    def after_test(self, runner: Runner) -> None: ...

    def after_run(self, runner: Runner) -> None: ...

    def on_exception(self, runner: Runner, *, exception: BaseException) -> None: ...

    # -- interval checks (MMEngine's names and meaning; n <= 0 is never) -----------------------
    @staticmethod
    def every_n_train_iters(runner: Runner, n: int) -> bool:
        """Inside a train iteration: whether it is the n-th, 2n-th, ... of the run."""
        return n > 0 and (runner.iter + 1) % n == 0

    @staticmethod
    def every_n_epochs(runner: Runner, n: int) -> bool:
        """Inside a train epoch: whether it is the n-th, 2n-th, ... of the run."""
        return n > 0 and (runner.epoch + 1) % n == 0

    @staticmethod
    def every_n_inner_iters(batch_idx: int, n: int) -> bool:
        """Whether iteration `batch_idx` (0-based, in the epoch) is the n-th, 2n-th, ... of its epoch."""
        return n > 0 and (batch_idx + 1) % n == 0

    @staticmethod
    def end_of_epoch(runner: Runner, batch_idx: int) -> bool:
        """Whether iteration `batch_idx` is the last of its epoch (False for a loader without a length)."""
        return runner.steps_per_epoch is not None and batch_idx + 1 == runner.steps_per_epoch

    @staticmethod
    def is_last_train_iter(runner: Runner) -> bool:
        """Inside a train iteration: whether it is the last of the run's budget."""
        return runner.iter + 1 == runner.max_iters

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
