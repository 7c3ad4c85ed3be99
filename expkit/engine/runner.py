"""The Runner: owns the built objects, the hooks, their dispatch table and the run state.

It takes objects, never config: build them yourself (or let ``expkit.config.build`` do it from
Hydra) and hand them over. ``Runner.run()`` trains, validates, tests and writes
``result.json`` in the work dir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from expkit.checkpoint import run_checkpoint
from expkit.core import activation_checkpointing, atomic, distributed
from expkit.core.rng import algorithm_settings
from expkit.core.settings import TrainerSettings
from expkit.core.signals import requeue_signals, stop_on_signals
from expkit.core.stages import Stage
from expkit.engine import hook_table
from expkit.engine.devices import StepModule, move, precision, run_device
from expkit.engine.hook_table import NULL, HookTable
from expkit.engine.loops import EvalLoop, TrainLoop
from expkit.engine.state import RunState, TrainWindow
from expkit.hooks import default_hooks as make_default_hooks
from expkit.hooks.base import Hook
from expkit.loggers import logs
from expkit.loggers.backends import Backend
from expkit.metrics import Accuracy, Directions, MetricSlot, as_slots, probe_metrics
from expkit.optimizers import check_owned_update, owns_its_update
from expkit.workdir import provenance, results

if TYPE_CHECKING:
    from expkit.checkpoint.async_writer import BackgroundWriter

__all__ = ["Runner"]


log = logging.getLogger("expkit")


def _state_field(name: str) -> property:
    """``runner.<name>``: the run state's field of that name (``runner.state.<name>``), read and set."""

    def set_field(runner: Runner, value: Any) -> None:
        setattr(runner.state, name, value)

    return property(attrgetter(f"state.{name}"), set_field, doc=f"The run state's ``{name}`` (see ``RunState``).")


class Runner:
    """Trains ``model`` with ``optimizer`` on ``train_loader``; validates and tests.

    Every argument is keyword-only; ``expkit.config.build.build_runner`` makes them from a config.

    Args:
        model: the model; the task (``criterion``, or a task's own step) gives its loss.
        optimizer: one optimizer, a name -> optimizer mapping (a task with several, a GAN), or
            None (evaluation only).
        train_loader: the training batches; None for evaluation only.
        work_dir: the run's dir: checkpoints, metrics.jsonl, result.json, the loggers' files.
        val_loader: validation batches, each ``settings.val_interval`` epochs; None: none.
        test_loader: test batches, once after training (and the best checkpoint's); None: none.
        scheduler: a learning-rate scheduler, stepped each epoch or each iteration.
        scheduler_by_epoch: True steps ``scheduler`` after each epoch, False after each iteration.
        criterion: ``loss = criterion(output, target)`` for the plain supervised step.
        metrics: name -> any object with update/compute/reset (torchmetrics included), or a
            ``MetricSlot`` that says which step outputs it reads and its direction.
        monitor: the metric key (``val/acc``) whose best value result.json reports first;
            checked at start-up.
        settings: the trainer's settings (epochs, precision, strategy, ...); None: defaults.
        default_hooks: None gives the six defaults (see ``default_hooks()``); a mapping gives
            exactly those.
        hooks: custom hooks, a name -> hook mapping or a sequence. Default hooks register
            first; then everything is sorted by priority, ties kept in registration order.
        loggers: backends (TensorBoard, wandb, MLflow) the LoggerHook writes to besides
            metrics.jsonl.
        resume: True continues from ``work_dir``'s last checkpoint; a path, from that checkpoint.
        load_from: a checkpoint whose weights only are loaded (a new run from them).
        config: the composed config, saved in checkpoints and result.json.
        run_info: what the command knows of the run (its command line, the sweep job).
        data_info: what the data module says of itself (classes, shapes), saved for predict.
        inputs: the fingerprint of the files the data is read from (``expkit.data.inputs``), for
            provenance.json; None: not recorded.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None,
        train_loader: Iterable | None,
        work_dir: str | Path,
        val_loader: Iterable | None = None,
        test_loader: Iterable | None = None,
        scheduler: Any = None,
        scheduler_by_epoch: bool = True,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        metrics: Mapping[str, Any] | None = None,
        monitor: str | None = None,
        settings: TrainerSettings | None = None,
        default_hooks: Mapping[str, Hook] | None = None,
        hooks: Mapping[str, Hook] | Sequence[Hook] = (),
        loggers: Mapping[str, Backend] | None = None,
        resume: bool | str | Path = False,
        load_from: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
        run_info: Mapping[str, Any] | None = None,
        data_info: Mapping[str, Any] | None = None,
        inputs: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings or TrainerSettings()
        self.is_main = distributed.is_main()  # rank 0 writes checkpoints, metrics, backends, result.json
        self.device = run_device(self.settings)
        self.sharded = self.settings.strategy == "fsdp"  # sharded checkpoints (and FSDP2 under torchrun)
        self.model = self._placed_model(model, hooks, default_hooks)
        self.ddp_model: nn.Module | None = None
        # one optimizer, or several by name (a model that owns its update: train_step(batch, optimizers))
        self.optimizers: dict[str, torch.optim.Optimizer] = (
            dict(optimizer) if isinstance(optimizer, Mapping) else {"optimizer": optimizer} if optimizer else {}
        )
        self.named_optimizers = isinstance(optimizer, Mapping)  # checkpoints keep them by name
        self.schedulers: dict[str, Any] = (
            dict(scheduler) if isinstance(scheduler, Mapping) else {"scheduler": scheduler} if scheduler else {}
        )
        self.scheduler_by_epoch = scheduler_by_epoch
        self.manual_optimization = owns_its_update(self.model)
        check_owned_update(self)
        if distributed.is_distributed() and self.optimizer is not None and not self.sharded:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                StepModule(self), device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.test_loader = test_loader
        # default: the function (a loss module's call costs about 4 us more, every step)
        self.criterion = criterion if criterion is not None else nn.functional.cross_entropy
        self.metrics: dict[str, MetricSlot] = {
            name: slot.to(self.device)
            for name, slot in as_slots(metrics if metrics is not None else {"acc": Accuracy()}).items()
        }
        sets = {
            mode: list(loader)
            for mode, loader in (("val", val_loader), ("test", test_loader))
            if isinstance(loader, Mapping)
        }
        self.directions = Directions(self.metrics, sets)  # the one answer to "is greater better?" for every metric key
        self.eval_set: str | None = None  # the named val/test set being evaluated, if there are several
        self.monitor = monitor
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.resume_from = resume
        self.load_from = load_from
        # (path, checkpoint) the run starts from, read and checked before anything is written; () none
        self.start_checkpoint: tuple[Path, dict[str, Any]] | tuple[()] | None = None
        self.config = dict(config) if config is not None else None
        self.loggers: dict[str, Backend] = dict(loggers or {})  # TensorBoard, wandb: written by LoggerHook
        self.run_info = dict(run_info or {})
        self.data_info = dict(data_info or {})  # what the data module describes (num_classes: the start-up probe)
        self.inputs = dict(inputs) if inputs is not None else None  # what the data is read from (provenance)

        self.state = RunState()  # the run's counters, metrics and ending: read through the fields below
        # the iterations since the last logging step, for the hooks that run there only (timer, logger)
        self.train_window = TrainWindow()
        self.provenance: dict[str, Any] = {}  # provenance.json's record, once written (rank 0)

        self._autocast_dtype, self.scaler = precision(self.settings.precision, self.device)  # scaler: fp16 on CUDA
        # whether the loops call autocast() around forward passes (bf16, 16) and to_device() on batches
        # (work to do, or a Runner subclass's own)
        self.autocasts = self._autocast_dtype is not None or type(self).autocast is not Runner.autocast
        self.moves_batches = (
            self.device.type != "cpu" or self.settings.channels_last or type(self).to_device is not Runner.to_device
        )
        self.hook_table = HookTable()  # registration, order, dispatch, instrumentation
        self.instrumented = False
        self.hook_times = self.hook_table.hook_times  # (stage, hook name) -> [seconds, calls], while timing
        self.phase_times = self.hook_table.phase_times  # loop phase -> [seconds, calls], while timing
        self._register_hooks(default_hooks, hooks)
        # the signals that stop the run to be continued (trainer.requeue_signal, submitit's): stop_on_signals
        self.requeue_signals = requeue_signals(self.settings.requeue_signal)
        if self.settings.save_before_limit and self.is_main:  # (rank 0 decides; the others stop with it)
            self._watch_time_limit()

    def _placed_model(
        self, model: nn.Module, hooks: Mapping[str, Hook] | Sequence[Hook], default_hooks: Mapping[str, Hook] | None
    ) -> nn.Module:
        """The model as this process trains it: on its device (unless sharded), its blocks wrapped
        for activation checkpointing, channels-last and compiled as the settings ask."""
        if self.sharded:
            from expkit.engine import fsdp

            fsdp.check_runner_inputs(model, hooks, default_hooks)
        # a sharded model stays where shard() put it (with trainer.fsdp_offload, its shards in CPU memory)
        placed = model if self.sharded and distributed.is_distributed() else model.to(self.device)
        # the blocks are wrapped before compiling (a sharded model's were, before sharding)
        activation_checkpointing.apply(
            placed,
            self.settings.activation_checkpointing,
            self.settings.fsdp_blocks,
            compiled=self.settings.compile,
        )
        if self.settings.channels_last:
            placed = placed.to(memory_format=torch.channels_last)
        if self.settings.compile:
            # in place: the same module, state_dict keys and hooks; compiled on its first call
            placed.compile()
        return placed

    def _register_hooks(
        self, default_hooks: Mapping[str, Hook] | None, hooks: Mapping[str, Hook] | Sequence[Hook]
    ) -> None:
        """The default hooks first (the six when None), then the custom ones, by name (a sequence's
        by class name); ``register_hook`` keeps them sorted by priority, ties in this order."""
        defaults = default_hooks if default_hooks is not None else make_default_hooks()
        for name, hook in defaults.items():
            self.register_hook(hook, name=name)
        named = hooks.items() if isinstance(hooks, Mapping) else ((type(h).__name__, h) for h in hooks)
        for name, hook in named:
            self.register_hook(hook, name=name)

    def _watch_time_limit(self) -> None:
        """Under Slurm, a job with a time limit gets a TimeLimitHook (``trainer.save_before_limit``):
        Slurm is asked for the job's end once, here (on rank 0 alone: the others stop with it); outside
        Slurm nothing is imported, asked or added."""
        if "SLURM_JOB_ID" not in os.environ:
            return
        from expkit.core import slurm
        from expkit.hooks.time_limit import TimeLimitHook

        job = slurm.this_job()
        if job is None or job.end_time is None:
            return
        what = f"the time limit of Slurm job {job.job_id}"
        self.register_hook(TimeLimitHook(job.end_time, self.settings.limit_margin_s, what), name="time_limit")

    # the run state's fields, as hooks read them (runner.epoch is runner.state.epoch)
    epoch = _state_field("epoch")
    iter = _state_field("iter")
    inner_iter = _state_field("inner_iter")
    position = _state_field("position")
    epoch_start = _state_field("epoch_start")
    epoch_batches = _state_field("epoch_batches")
    run_started_s = _state_field("run_started_s")
    earlier_wall_s = _state_field("earlier_wall_s")
    batch_ready_s = _state_field("batch_ready_s")
    val_metrics = _state_field("val_metrics")
    test_metrics = _state_field("test_metrics")
    best_metrics = _state_field("best_metrics")
    best_checkpoints = _state_field("best_checkpoints")
    last_checkpoint = _state_field("last_checkpoint")
    scalars = _state_field("scalars")
    extra_scalars = _state_field("extra_scalars")
    resuming = _state_field("resuming")
    load_purpose = _state_field("load_purpose")
    load_source = _state_field("load_source")
    test_checkpoint = _state_field("test_checkpoint")
    status = _state_field("status")
    stop_reason = _state_field("stop_reason")
    stop_status = _state_field("stop_status")
    stop_signal = _state_field("stop_signal")
    stopped_by_signal = _state_field("stopped_by_signal")
    stop_resumable = _state_field("stop_resumable")
    requeue = _state_field("requeue")
    error = _state_field("error")

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The (first) optimizer: its first group's lr is logged as train/lr."""
        return next(iter(self.optimizers.values()), None)

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer | None) -> None:
        self.optimizers = {"optimizer": value} if value is not None else {}
        self.named_optimizers = False

    @property
    def scheduler(self) -> Any:
        """The (first) scheduler; setting it replaces the run's schedulers with this one."""
        return next(iter(self.schedulers.values()), None)

    @scheduler.setter
    def scheduler(self, value: Any) -> None:
        self.schedulers = {"scheduler": value} if value is not None else {}

    # -- hooks (the table is expkit.engine.hook_table's) --------------------------------------------
    @property
    def hooks(self) -> list[Hook]:
        """The registered hooks, in firing order."""
        return self.hook_table.hooks

    def hook_names(self) -> list[str]:
        """The hooks' names (``checkpoint``, ``EMAHook``, ...), in firing order."""
        return self.hook_table.names

    def register_hook(self, hook: Hook, name: str | None = None, priority: int | str | None = None) -> None:
        """Add a hook; `priority` beats the hook's own `priority` attribute."""
        self.hook_table.register(hook, name, priority)

    call_hook = hook_table.call_hook  # (stage, **payload): every hook at a stage, in order

    def instrument(self, *, markers: bool | None = None, timing: bool | None = None) -> None:
        """``markers``: wrap every stage, hook call and loop phase in ``record_function`` so
        they show by name in profiler traces. ``timing``: add up the seconds of every hook at
        every stage (``hook_times``) and of every loop phase (``phase_times``). Off by default:
        then it costs nothing."""
        table = self.hook_table
        if markers is not None:
            table.markers = markers
        if timing is not None:
            table.timing = timing
        self.instrumented = table.instrumented
        if self.instrumented:
            self.call_hook = lambda stage, **payload: table.call_instrumented(self, stage, payload)  # type: ignore[method-assign]
        else:
            self.__dict__.pop("call_hook", None)

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A loop phase (data, forward, backward, optimizer): marked and timed when instrumented."""
        return self.hook_table.phase(name) if self.instrumented else NULL

    def hook_order_table(self) -> str:
        """The resolved order per stage, as printed at start-up."""
        return self.hook_table.order_table()

    def request_stop(self, reason: str, status: str = "stopped", resumable: bool = False) -> None:
        """Ask the loop to stop after the current iteration (first reason wins). `status` is
        what result.json will say: ``stopped`` (early stopping, a signal) or ``pruned`` (a
        search gave up on this trial: the test pass is skipped too). `resumable`: an
        interruption, not an end (the test pass is skipped; ``resume=true`` goes on), which
        `reason` then says by beginning with ``interrupted``."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_status = reason, status
            self.stopped_by_signal = self.stop_signal is not None
            self.stop_resumable = resumable
            log.info("Stop requested: %s", reason)

    # -- the run --------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        """Training iterations (optimizer steps) per epoch; None for a loader without a length."""
        if not hasattr(self.train_loader, "__len__"):
            return None
        return self.settings.steps_per_epoch(len(self.train_loader))  # type: ignore[arg-type]

    @property
    def max_iters(self) -> int:
        """The total number of training iterations (optimizer steps) of this run."""
        if self.settings.max_iters is not None:
            return self.settings.max_iters
        return self.settings.max_epochs * self.steps_per_epoch  # type: ignore[operator]

    def run(self) -> dict[str, Any]:
        """before_run, [load], train, test, after_run; writes and returns result.json's content."""
        started = self.state.run_started_s = time.time()
        status, error, tb = "completed", None, None
        # a refused resume raises here, before anything is written: the run dir stays as it was
        run_checkpoint.check_start(self)
        logs.show_progress()
        if log.isEnabledFor(logging.INFO):  # (the table per stage: show_hooks=true, or hook_order_table())
            log.info("Hooks: %s", ", ".join(self.hook_names()))
        # room for result.json and provenance.json however full the disk gets during the run
        reserve = atomic.SpaceReserve(self.work_dir / ".result.reserve") if self.is_main else None
        settings = (
            self.settings.deterministic,
            self.settings.cudnn_benchmark and self.device.type == "cuda",  # (cuDNN's benchmark mode)
            self.settings.flush_denormal,
        )
        recorded: Callable[[], dict[str, Any]] = dict
        with algorithm_settings(*settings), stop_on_signals(self):
            try:
                try:
                    # git's process runs while before_run, the probe and a resume do (read after them)
                    if self.is_main:
                        recorded = provenance.start(self.work_dir, inputs=self.inputs)
                    self._check_monitor_reported()
                    # hooks check their metrics here and declare explicit rules, before monitor's rule is decided
                    self.call_hook(Stage.BEFORE_RUN)
                    self._decide_monitor_rule()
                    if self.val_loader is not None and self.optimizer is not None:
                        probe_metrics(self)  # (and the model's outputs against the data's classes)
                    run_checkpoint.load_or_resume(self)
                    self.provenance = recorded()  # (git ran meanwhile)
                    if self.train_loader is not None and self.optimizer is not None:
                        self.train()
                    elif self.val_loader is not None:  # nothing to train: evaluate
                        self.validate()
                    # no test after a signal or an interruption (the resumed run tests) or a pruning
                    if (
                        self.test_loader is not None
                        and self.stop_signal is None
                        and not self.stop_resumable
                        and self.stop_status != "pruned"
                    ):
                        run_checkpoint.load_test_weights(self)
                        self.test()
                    if self.stop_reason is not None:
                        status = self.stop_status
                except BaseException as exc:
                    if isinstance(exc, KeyboardInterrupt) and self.stop_signal is not None:
                        # a second Ctrl-C while stopping: stopped, not failed; resumable from the last
                        # complete checkpoint (a save it cut short never got its name)
                        status = "stopped"
                        first = signal.Signals(self.stop_signal).name
                        self.stop_reason = f"signal {first}, then SIGINT again before the stop completed"
                        raise
                    status, error = "failed", results.failure_message(exc, self.run_info.get("resume_command"))
                    self.error = error
                    tb = traceback.format_exc()
                    try:
                        self.call_hook(Stage.ON_EXCEPTION, exception=exc)
                    except Exception as hook_exc:
                        # logged: the run's own error stays the one raised
                        log.error("Also, after the run had failed: %s", results.failure_message(hook_exc))
                    raise
                finally:
                    self.status = status
                    try:
                        self.call_hook(Stage.AFTER_RUN)
                    except BaseException as exc:  # (a Ctrl-C there too): the run failed, if nothing else did
                        if error is None:
                            status, error, tb = "failed", results.failure_message(exc), traceback.format_exc()
                            self.status, self.error = status, error
                            raise
                        log.error("Also, after the run had failed: %s", results.failure_message(exc))
            finally:
                # result.json is written before the signal handlers go: torchrun's SIGTERM to the
                # surviving ranks must not cut the write short
                self.provenance = recorded()
                wall_time = time.time() - started
                result = results.run_result(self, status, error, tb, wall_time)
                results.write_run_result(self, result, wall_time, reserve)
        return result

    def validation_due(self, count: int) -> bool:
        """Whether training validates after `count` completed epochs (iterations when
        iteration-based): every `val_interval` from `val_begin`, and at the end."""
        s = self.settings
        if self.val_loader is None or count < s.val_begin:
            return False
        last = s.max_iters if s.max_iters is not None else s.max_epochs
        return count % s.val_interval == 0 or count == last

    def train(self) -> None:
        """Train until the budget is spent or a stop is requested, validating when due."""
        TrainLoop(self).run()

    def validate(self) -> dict[str, float]:
        """One pass over the val loader(s); returns ``{"val/loss": ..., "val/<metric>": ...}``."""
        return EvalLoop(self, self.val_loader, "val").run()

    def test(self) -> dict[str, float]:
        """One pass over the test loader(s); returns ``{"test/loss": ..., "test/<metric>": ...}``."""
        return EvalLoop(self, self.test_loader, "test").run()

    def record_eval(self, mode: str, metrics: dict[str, float]) -> None:
        """The run state takes a pass's results before its hooks see them: a checkpoint saved
        after validation holds this validation's metrics and best values."""
        if mode == "val":
            self.val_metrics = metrics
            self.directions.track_best(self.best_metrics, metrics, self.epoch, self.iter)
        else:
            self.test_metrics = metrics

    def _check_monitor_reported(self) -> None:
        """Before the hooks' own checks, whether validation reports `monitor`: the hooks' keys follow it
        by default (save_best=${monitor}), so a typo is named as the user's monitor=, not as a key
        they never typed. Its rule is decided after the hooks have declared theirs."""
        if self.monitor is not None and self.val_loader is not None and self.optimizer is not None:
            self.directions.check_reported(self.monitor, "monitor")

    def _decide_monitor_rule(self) -> None:
        """After the hooks' before_run: `monitor`'s direction, from the rules they declared (whether
        validation reports it was checked before them)."""
        if self.monitor is not None:
            self.directions.require(self.monitor, "monitor")

    def metric_rule(self, key: str, by: str, rule: str | None = None) -> str:
        """For hooks at before_run: check that validation will report `key` (when this run
        validates) and return its direction; an explicit `rule` (a hook's own setting) is
        declared for the whole run. `by` names the setting in errors."""
        if self.val_loader is not None and self.optimizer is not None:
            self.directions.check_reported(key, by)
        if rule is not None:
            self.directions.declare(key, rule, by.rsplit(".", 1)[0] + ".rule")
        return self.directions.require(key, by)

    # -- the step ---------------------------------------------------------------------------
    def to_device(self, batch: Any) -> Any:
        """The batch's tensors on the run's device (and channels-last, when set)."""
        if self.device.type == "cpu" and not self.settings.channels_last:
            return batch
        return move(batch, self.device, self.settings.channels_last)

    def autocast(self) -> contextlib.AbstractContextManager:
        """``trainer.precision``'s autocast (bf16, 16), or a no-op context in fp32."""
        if self._autocast_dtype is None:
            return NULL
        return torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def train_step(self, data_batch: Any) -> dict[str, Any]:
        """Forward and loss for a plain model; a model with its own ``train_step(batch)``
        returning ``{"loss": ...}`` is called instead (see TrainLoop)."""
        inputs, targets = data_batch
        logits = self.model(inputs)
        return {"loss": self.criterion(logits, targets), "logits": logits}

    def eval_step(self, data_batch: Any) -> dict[str, Any]:
        """Forward for val/test: a dict with ``loss``, ``logits`` and ``targets`` (a model's own
        ``eval_step`` may add more, e.g. ``preds``, for metrics to read by name)."""
        if hasattr(self.model, "eval_step"):
            return self.model.eval_step(data_batch)
        return self.plain_eval_step(data_batch)

    def eval_step_function(self) -> Callable[[Any], dict[str, Any]]:
        """What ``eval_step`` calls per batch, looked up once (a val/test pass does, as training
        looks up ``train_step`` once): a missing ``eval_step`` on a module costs an AttributeError
        each time. A Runner subclass's own ``eval_step`` is always the one."""
        if type(self).eval_step is not Runner.eval_step or "eval_step" in self.__dict__:
            return self.eval_step
        own = getattr(self.model, "eval_step", None)
        return own if own is not None else self.plain_eval_step

    def plain_eval_step(self, data_batch: Any) -> dict[str, Any]:
        """``eval_step`` for a model without its own: (inputs, targets) -> logits, loss."""
        inputs, targets = data_batch
        logits = self.model(inputs)
        return {"loss": self.criterion(logits, targets), "logits": logits, "targets": targets}

    # -- checkpoints (what they hold and resuming: expkit.checkpoint.run_checkpoint) ------------------------
    def state_checkpoint(self, save_optimizer: bool = True, save_scheduler: bool = True) -> dict[str, Any]:
        """Everything needed to continue this run exactly."""
        return run_checkpoint.state_checkpoint(self, save_optimizer, save_scheduler)

    def save_checkpoint(
        self,
        path: Path,
        *,
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        is_best: bool = False,
        metric: str | None = None,
        durable: bool = False,
        writer: BackgroundWriter | None = None,
    ) -> Path:
        """Write a checkpoint atomically (`durable`: fsync too); regular ones move `last_checkpoint`.
        With trainer.strategy=fsdp it is a sharded directory (``<name>.dcp``, every rank writes
        its shard). With a `writer` (``expkit.checkpoint.async_writer``), only the copy of the state
        happens now: the file is written in the writer's thread, and hooks'
        ``after_save_checkpoint`` runs once it is complete (at the writer's next ``wait``).
        Returns the path written (or being written)."""
        return run_checkpoint.save_checkpoint(
            self,
            path,
            save_optimizer=save_optimizer,
            save_scheduler=save_scheduler,
            is_best=is_best,
            metric=metric,
            durable=durable,
            writer=writer,
        )

    def checkpoint_name(self, name: str) -> str:
        """The name a checkpoint file name gets on disk: ``epoch_3.pth``, or with
        trainer.strategy=fsdp the sharded directory ``epoch_3.dcp``."""
        return run_checkpoint.checkpoint_name(self, name)

    def epoch_samples(self) -> int | None:
        """Samples of this epoch's order trained on so far, by all processes together (what a
        mid-epoch resume skips, with any number of processes); None without a batch size."""
        batch_size = getattr(self.train_loader, "batch_size", None)
        if not isinstance(batch_size, int):
            return None
        # the samples skipped when this process took the epoch up, then every process's batches since
        start, world = self.epoch_start, distributed.rank_and_world()[1]
        batches_since = self.position.inner_iter - start.inner_iter
        return start.samples + batches_since * batch_size * world

    @property
    def epoch_complete(self) -> bool:
        """True inside after_train_epoch when the epoch ran to its end (not cut short by a stop)."""
        return self.position.epoch > self.epoch
