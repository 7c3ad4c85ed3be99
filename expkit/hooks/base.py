"""The Hook base class: one no-op method per Stage, payloads as keyword arguments.

Override only the stages you need; the Runner calls a hook only at the stages it
overrides, so an unused stage costs nothing. Stages in firing order (see
``expkit.stages`` for the loop as pseudocode):

==========================  ==========================================  =====================
stage                       payload                                     fires
==========================  ==========================================  =====================
before_run                  -                                           once, first
after_load_checkpoint       checkpoint: dict (not yet applied)          on resume / load_from,
                                                                        and before the test
                                                                        with test_with=best
before_train                -                                           training starts
before_train_epoch          -                                           each epoch
before_train_iter           batch_idx, data_batch                       each iteration
after_forward               batch_idx, data_batch, outputs              loss computed
after_backward              batch_idx, data_batch, outputs              gradients ready
after_optimizer_step        batch_idx, data_batch, outputs              weights updated
after_train_iter            batch_idx, data_batch, outputs              each iteration
after_train_epoch           -                                           each epoch, also a
                                                                        stopped one
before_val / _epoch         -                                           each validation
before_val_iter             batch_idx, data_batch
after_val_iter              batch_idx, data_batch, outputs
after_val_epoch             metrics: dict[str, float] ("val/acc", ...)
after_val                   -
before_save_checkpoint      checkpoint: dict (add your keys)            each save
after_save_checkpoint       path: Path, is_best: bool, metric: str|None each save
after_train                 -                                           training ends,
                                                                        also after a stop
before_test ... after_test  as for val ("test/acc", ...)                with a test loader
after_run                   -                                           always, last; also
                                                                        after an exception
on_exception                exception: BaseException                    the run raised
==========================  ==========================================  =====================

``outputs`` is the dict the step returned (``loss`` tensor, ``logits``, ...).
After ``runner.request_stop(reason)`` the current iteration finishes, then
after_train_epoch, after_train, the test (not after a SIGTERM/SIGINT) and after_run still
fire. After an exception: on_exception, then after_run, then the exception propagates.
after_run may run twice; make it idempotent. ``runner.load_purpose`` says why a
checkpoint was loaded (resume, load_from, test).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from expkit.stages import Priority

if TYPE_CHECKING:
    from expkit.runner import Runner


class Hook:
    """Base class of every hook. Subclasses set ``priority`` and override stage methods."""

    priority: ClassVar[int | str | Priority] = Priority.NORMAL
    # False: the hook does not work with sharded (FSDP2, DTensor) parameters; a run with
    # trainer.strategy=fsdp refuses it at start-up instead of failing (or hanging) later
    supports_sharding: ClassVar[bool] = True

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
