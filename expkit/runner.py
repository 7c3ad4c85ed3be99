"""The Runner: owns the built objects, the hooks, their dispatch table and the run state.

It takes objects, never config: build them yourself (or let ``expkit.build`` do it from
Hydra) and hand them over. ``Runner.run()`` trains, validates, tests and writes
``result.json`` in the work dir.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from expkit import checkpoint_io, distributed, provenance
from expkit.backends import Backend
from expkit.errors import CheckpointWriteError, ConfigError, ExpkitError, HookError
from expkit.hooks.base import Hook
from expkit.loops import EvalLoop, TrainLoop
from expkit.metrics import Accuracy, Directions, MetricSlot, as_slots, better
from expkit.optimizers import owns_its_update
from expkit.rng import rng_states, seed_everything, set_deterministic, set_rng_states  # noqa: F401 (re-exported)
from expkit.settings import TrainerSettings
from expkit.stages import Stage, get_priority, priority_name

log = logging.getLogger("expkit")

_STAGE_NAMES = frozenset(s.value for s in Stage)
# keyword payload of each stage, read off the base class signatures
_PAYLOADS: dict[str, tuple[str, ...]] = {
    s.value: tuple(p for p in inspect.signature(getattr(Hook, s.value)).parameters if p not in ("self", "runner"))
    for s in Stage
}


def default_hooks(**overrides: Hook | None) -> dict[str, Hook]:
    """MMEngine's six default hooks by name; pass NAME=hook to replace, NAME=None to drop."""
    from expkit.hooks import (
        CheckpointHook,
        DistSamplerSeedHook,
        IterTimerHook,
        LoggerHook,
        ParamSchedulerHook,
        RuntimeInfoHook,
    )

    hooks: dict[str, Hook | None] = {
        "runtime_info": RuntimeInfoHook(),
        "timer": IterTimerHook(),
        "sampler_seed": DistSamplerSeedHook(),
        "logger": LoggerHook(),
        "param_scheduler": ParamSchedulerHook(),
        "checkpoint": CheckpointHook(interval=1),
    }
    hooks.update(overrides)
    return {name: hook for name, hook in hooks.items() if hook is not None}


_make_default_hooks = default_hooks  # the Runner's `default_hooks` argument shadows the name


class _StepModule(nn.Module):
    """The training step as a module, so DistributedDataParallel wraps the whole step,
    including a model's own train_step (gradients are averaged over ranks in backward)."""

    def __init__(self, runner: Runner) -> None:
        super().__init__()
        self.model = runner.model
        self._runner = [runner]  # a list: not registered as a submodule

    def forward(self, data_batch: Any) -> dict[str, Any]:
        if hasattr(self.model, "train_step"):
            return self.model.train_step(data_batch)
        return self._runner[0].train_step(data_batch)


_NULL = contextlib.nullcontext()  # shared: entering it costs next to nothing


def _add_time(table: dict[Any, list[float]], key: Any, seconds: float) -> None:
    entry = table.get(key)
    if entry is None:
        table[key] = [seconds, 1]
    else:
        entry[0] += seconds
        entry[1] += 1


class _Phase:
    """Times a loop phase into runner.phase_times and marks it for the profiler."""

    __slots__ = ("discard", "marker", "name", "runner", "start")

    def __init__(self, runner: Runner, name: str) -> None:
        self.runner, self.name, self.discard = runner, name, False

    def __enter__(self) -> _Phase:  # noqa: PYI034 - Self needs Python 3.11
        self.marker = torch.profiler.record_function(f"phase/{self.name}") if self.runner._markers else None
        if self.marker is not None:
            self.marker.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        if self.runner._timing and not self.discard:
            _add_time(self.runner.phase_times, self.name, elapsed)
        if self.marker is not None:
            self.marker.__exit__(*exc)


def run_device(settings: TrainerSettings) -> torch.device:
    """The device of this process: ``trainer.device`` (auto: cuda when available), and under
    torchrun on GPUs, this rank's own GPU."""
    name = settings.device
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if distributed.is_distributed() and device.type == "cuda":
        device = torch.device("cuda", distributed.local_rank())
    return device


def _move(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Tensors to `device` without waiting for the copy (from pinned memory it overlaps with
    compute); with `channels_last`, 4-D floating tensors (images) also change layout."""
    if isinstance(batch, torch.Tensor):
        if channels_last and batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, non_blocking=True, memory_format=torch.channels_last)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(b, device, channels_last) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _move(v, device, channels_last) for k, v in batch.items()}
    return batch


class Runner:
    """Trains ``model`` with ``optimizer`` on ``train_loader``; validates and tests.

    ``loggers``: backends (TensorBoard, wandb) the LoggerHook writes to besides metrics.jsonl.
    ``metrics``: name -> any object with update/compute/reset (torchmetrics included), or a
    ``MetricSlot`` that says which step outputs it reads and its direction. ``monitor``: the
    metric key (``val/acc``) whose best value result.json reports first; checked at start-up.
    ``default_hooks``: None gives the six defaults (see ``default_hooks()``); a mapping
    gives exactly those. ``hooks``: custom hooks, a name->hook mapping or a sequence.
    Default hooks register first; then everything is sorted by priority, ties kept in
    registration order. ``resume``: True continues from ``work_dir``'s last checkpoint,
    a path from that checkpoint. ``load_from``: a checkpoint whose weights only are loaded.
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
    ) -> None:
        self.settings = settings or TrainerSettings()
        self.is_main = distributed.is_main()  # rank 0 writes checkpoints, metrics, backends, result.json
        self.device = run_device(self.settings)
        self.sharded = self.settings.strategy == "fsdp"  # sharded checkpoints (and FSDP2 under torchrun)
        if self.sharded:
            _check_fsdp(model, hooks, default_hooks)
        self.model = model.to(self.device)
        if self.settings.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        if self.settings.compile:
            self.model.compile()  # in place: the same module, state_dict keys and hooks; compiled on first call
        self.ddp_model: nn.Module | None = None
        # one optimizer, or several by name (a model that owns its update: train_step(batch, optimizers))
        self.optimizers: dict[str, torch.optim.Optimizer] = (
            dict(optimizer) if isinstance(optimizer, Mapping) else {"optimizer": optimizer} if optimizer else {}
        )
        self._named_optimizers = isinstance(optimizer, Mapping)
        self.schedulers: dict[str, Any] = (
            dict(scheduler) if isinstance(scheduler, Mapping) else {"scheduler": scheduler} if scheduler else {}
        )
        self.scheduler_by_epoch = scheduler_by_epoch
        self.manual_optimization = owns_its_update(self.model)
        if len(self.optimizers) > 1 and not self.manual_optimization:
            raise ConfigError(f"optim defines {len(self.optimizers)} optimizers ({', '.join(self.optimizers)}): the model "
                              "must own its update, with a train_step(batch, optimizers) that uses them")  # fmt: skip
        if self.manual_optimization and self.settings.accumulate_grad_batches > 1:
            raise ConfigError("trainer.accumulate_grad_batches > 1 with a model that owns its update (train_step(batch, "
                              "optimizers)): accumulate inside train_step instead")  # fmt: skip
        if distributed.is_distributed() and self.sharded and self.manual_optimization:
            raise ConfigError("a model that owns its update (train_step(batch, optimizers)) is not supported with "
                              "trainer.strategy=fsdp yet; train it with trainer.strategy=ddp")  # fmt: skip
        if distributed.is_distributed() and self.optimizer is not None and not self.sharded:
            if self.manual_optimization:
                raise ConfigError("a model that owns its update (train_step(batch, optimizers)) cannot run under DDP "
                                  "yet: DDP needs the backward outside the forward; train it in one process")  # fmt: skip
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                _StepModule(self), device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.test_loader = test_loader
        self.criterion = criterion or nn.CrossEntropyLoss()
        self.metrics: dict[str, MetricSlot] = {
            name: slot.to(self.device)
            for name, slot in as_slots(metrics if metrics is not None else {"acc": Accuracy()}).items()
        }
        sets = {mode: list(loader) for mode, loader in (("val", val_loader), ("test", test_loader))
                if isinstance(loader, Mapping)}  # fmt: skip
        self.directions = Directions(self.metrics, sets)  # the one answer to "is greater better?" for every metric key
        self.eval_set: str | None = None  # the named val/test set being evaluated, if there are several
        self.monitor = monitor
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.resume_from = resume
        self.load_from = load_from
        self.config = dict(config) if config is not None else None
        self.loggers: dict[str, Backend] = dict(loggers or {})  # TensorBoard, wandb: written by LoggerHook
        self.run_info = dict(run_info or {})

        # run state; counters follow MMEngine (see expkit.stages)
        self.epoch = 0
        self.iter = 0
        self.inner_iter = 0  # batches consumed in the current epoch (for exact mid-epoch resume)
        self.position = (0, 0, 0)  # (epochs, iters, inner iters) completed: what a checkpoint records
        self.resuming = False  # True once this run continues from a resume checkpoint
        self.load_purpose = ""  # why the last checkpoint was loaded: resume, load_from or test
        self.test_checkpoint: str | None = None  # the weights the test used
        self.stop_reason: str | None = None
        self.error: str | None = None  # why the run failed, in one line (result.json's "error")
        self.stop_status = "stopped"  # result.json's status after a stop: stopped or pruned
        self.status = "running"  # then completed, stopped or failed (set before after_run)
        self.stop_signal: int | None = None  # the signal number when a signal asked to stop
        self.scalars: dict[str, float] = {}  # latest values hooks publish (train/time, ...)
        self.val_metrics: dict[str, float] = {}
        self.test_metrics: dict[str, float] = {}
        self.best_metrics: dict[str, dict[str, Any]] = {}
        self.best_checkpoints: dict[str, str] = {}
        self.last_checkpoint: Path | None = None

        self._autocast_dtype = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}[self.settings.precision]
        self.scaler = (
            torch.amp.GradScaler("cuda")
            if self._autocast_dtype is torch.float16 and self.device.type == "cuda"
            else None
        )

        self._hooks: list[tuple[str, int, Hook]] = []
        self._build_dispatch()
        self._markers = self._timing = self.instrumented = False
        self.hook_times: dict[tuple[str, str], list[float]] = {}  # (stage, hook) -> [seconds, calls], when timing
        self.phase_times: dict[str, list[float]] = {}  # loop phase -> [seconds, calls], when timing
        self.extra_scalars: dict[str, float] = {}  # hooks' values for the next log record (cleared there)
        hooks_in = default_hooks if default_hooks is not None else _make_default_hooks()
        for name, hook in hooks_in.items():
            self.register_hook(hook, name=name)
        named = hooks.items() if isinstance(hooks, Mapping) else ((type(h).__name__, h) for h in hooks)
        for name, hook in named:
            self.register_hook(hook, name=name)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The (first) optimizer: its first group's lr is logged as train/lr."""
        return next(iter(self.optimizers.values()), None)

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer | None) -> None:
        self.optimizers = {"optimizer": value} if value is not None else {}
        self._named_optimizers = False

    @property
    def scheduler(self) -> Any:
        """The (first) scheduler; setting it replaces the run's schedulers with this one."""
        return next(iter(self.schedulers.values()), None)

    @scheduler.setter
    def scheduler(self, value: Any) -> None:
        self.schedulers = {"scheduler": value} if value is not None else {}

    # -- hooks ----------------------------------------------------------------------------
    @property
    def hooks(self) -> list[Hook]:
        return [hook for _, _, hook in self._hooks]

    def hook_names(self) -> list[str]:
        return [name for name, _, _ in self._hooks]

    def register_hook(self, hook: Hook, name: str | None = None, priority: int | str | None = None) -> None:
        """Add a hook; `priority` beats the hook's own `priority` attribute."""
        if not isinstance(hook, Hook):
            raise TypeError(f"hook {name or hook!r} must be an instance of expkit.Hook, got {type(hook).__name__}")
        name = name or type(hook).__name__
        taken, base, k = set(self.hook_names()), name, 2
        while name in taken:  # a second hook of the same class: Name_2, Name_3, ...
            name, k = f"{base}_{k}", k + 1
        _check_hook_methods(hook, name)
        try:
            value = get_priority(priority if priority is not None else hook.priority)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"hook {name} ({type(hook).__name__}): {exc}") from None
        # insert after the last hook with priority <= value: ties keep registration order
        index = len(self._hooks)
        while index > 0 and self._hooks[index - 1][1] > value:
            index -= 1
        self._hooks.insert(index, (name, value, hook))
        self._build_dispatch()

    def _build_dispatch(self) -> None:
        """For each stage, the hooks that override it, in order. Unused stages cost nothing."""
        self._dispatch: dict[str, tuple[tuple[str, str, Callable], ...]] = {}
        for stage in Stage:
            self._dispatch[stage.value] = tuple(
                (type(hook).__name__, name, getattr(hook, stage.value))
                for name, _, hook in self._hooks
                if getattr(type(hook), stage.value) is not getattr(Hook, stage.value)
            )

    def call_hook(self, stage: str, **payload: Any) -> None:
        """Run every hook registered at `stage`; an error names the hook and the stage."""
        for class_name, _, method in self._dispatch[stage]:
            try:
                method(self, **payload)
            except HookError:
                raise
            except ConfigError as exc:  # bad input found by a hook: still the user's to fix
                raise ConfigError(f"in {class_name}.{stage}: {exc}") from exc
            except Exception as exc:
                raise HookError(class_name, stage, f"{type(exc).__name__}: {exc}") from exc

    # -- instrumentation (off by default: then it costs nothing) ------------------------------
    def instrument(self, *, markers: bool | None = None, timing: bool | None = None) -> None:
        """``markers``: wrap every stage, hook call and loop phase in ``record_function`` so
        they show by name in profiler traces. ``timing``: add up the seconds of every hook at
        every stage (``hook_times``) and of every loop phase (``phase_times``)."""
        if markers is not None:
            self._markers = markers
        if timing is not None:
            self._timing = timing
        instrumented = self._markers or self._timing
        if instrumented:
            self.call_hook = self._call_hook_instrumented  # type: ignore[method-assign]
        else:
            self.__dict__.pop("call_hook", None)
        self.instrumented = instrumented

    def _call_hook_instrumented(self, stage: str, **payload: Any) -> None:
        markers = self._markers
        with torch.profiler.record_function(f"stage/{stage}") if markers else _NULL:
            for class_name, name, method in self._dispatch[stage]:
                start = time.perf_counter()
                try:
                    with torch.profiler.record_function(f"{class_name}.{stage}") if markers else _NULL:
                        method(self, **payload)
                except HookError:
                    raise
                except ConfigError as exc:
                    raise ConfigError(f"in {class_name}.{stage}: {exc}") from exc
                except Exception as exc:
                    raise HookError(class_name, stage, f"{type(exc).__name__}: {exc}") from exc
                finally:
                    if self._timing:
                        _add_time(self.hook_times, (stage, name), time.perf_counter() - start)

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A loop phase (data, forward, backward, optimizer): marked and timed when instrumented."""
        if not self.instrumented:
            return _NULL
        return _Phase(self, name)

    def hook_order_table(self) -> str:
        """The resolved order per stage, as printed at start-up."""
        lines = ["Hooks, in the order they run at each stage:"]
        for stage in Stage:
            entries = [
                f"({priority_name(p):<12}) {type(h).__name__} [{n}]"
                for n, p, h in self._hooks
                if getattr(type(h), stage.value) is not getattr(Hook, stage.value)
            ]
            if entries:
                lines.append(f"{stage.value}:")
                lines.extend(f"    {e}" for e in entries)
        return "\n".join(lines)

    def request_stop(self, reason: str, status: str = "stopped") -> None:
        """Ask the loop to stop after the current iteration (first reason wins). `status` is
        what result.json will say: ``stopped`` (early stopping, a signal) or ``pruned`` (a
        search gave up on this trial: the test pass is skipped too)."""
        if self.stop_reason is None:
            self.stop_reason, self.stop_status = reason, status
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
        started = time.time()
        status, error, tb = "completed", None, None
        if not log.hasHandlers():  # used from Python with logging unconfigured: still show progress
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        log.info(self.hook_order_table())
        previous_determinism = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                                torch.backends.cudnn.benchmark)  # fmt: skip
        if self.settings.deterministic:
            set_deterministic()
        elif self.settings.cudnn_benchmark and self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: cuDNN times its kernels once, then reuses
        self.provenance = provenance.write(self.work_dir) if self.is_main else {}
        # room for result.json and provenance.json however full the disk gets during the run
        reserve = checkpoint_io.SpaceReserve(self.work_dir / ".result.reserve") if self.is_main else None
        previous_handlers = self._catch_signals()
        try:
            try:
                self.call_hook(Stage.BEFORE_RUN)  # hooks check their metrics here and declare explicit rules
                if self.monitor is not None:
                    self.metric_rule(self.monitor, "monitor")
                if self.val_loader is not None and self.optimizer is not None:
                    self._check_metrics()
                self._load_or_resume()
                if self.train_loader is not None and self.optimizer is not None:
                    self.train()
                elif self.val_loader is not None:  # nothing to train: evaluate
                    self.validate()
                if self.test_loader is not None and self.stop_signal is None and self.stop_status != "pruned":
                    self._load_test_weights()  # (preempted: test after resuming)
                    self.test()
                if self.stop_reason is not None:
                    status = self.stop_status
            except BaseException as exc:
                status, error = "failed", (str(exc) if isinstance(exc, ExpkitError) else f"{type(exc).__name__}: {exc}")
                if isinstance(exc, KeyboardInterrupt):
                    error = "interrupted (KeyboardInterrupt)"
                peer = distributed.peer_failure(exc)  # another rank died: say which, in one line
                if peer is not None:
                    resume = self.run_info.get("resume_command")
                    error = peer + (f"; resume with: {resume}" if resume else "")
                self.error = error
                tb = traceback.format_exc()
                with contextlib.suppress(Exception):
                    self.call_hook(Stage.ON_EXCEPTION, exception=exc)
                raise
            finally:
                self.status = status
                try:
                    self.call_hook(Stage.AFTER_RUN)
                except Exception as exc:
                    if error is None:
                        status, error, tb = "failed", str(exc), traceback.format_exc()
                        raise
        finally:
            torch.use_deterministic_algorithms(previous_determinism[0])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous_determinism[1:]
            try:  # written before the signal handlers go: torchrun's SIGTERM to survivors must not cut it
                result = self._write_result(status, error, tb, time.time() - started, reserve)
            finally:
                for signum, handler in previous_handlers.items():
                    signal.signal(signum, handler)
        return result

    def _catch_signals(self) -> dict[int, Any]:
        """SIGTERM / SIGINT (preemption, Ctrl-C) become a stop request: the current iteration
        finishes, the checkpoint hook saves, result.json says stopped. A second Ctrl-C
        interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: Any) -> None:
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.request_stop(f"signal {signal.Signals(signum).name}")

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def validation_due(self, count: int) -> bool:
        """Whether training validates after `count` completed epochs (iterations when
        iteration-based): every `val_interval` from `val_begin`, and at the end."""
        s = self.settings
        if self.val_loader is None or count < s.val_begin:
            return False
        last = s.max_iters if s.max_iters is not None else s.max_epochs
        return count % s.val_interval == 0 or count == last

    def train(self) -> None:
        TrainLoop(self).run()

    def validate(self) -> dict[str, float]:
        return EvalLoop(self, self.val_loader, "val").run()

    def test(self) -> dict[str, float]:
        return EvalLoop(self, self.test_loader, "test").run()

    def record_eval(self, mode: str, metrics: dict[str, float]) -> None:
        """The run state takes a pass's results before its hooks see them: a checkpoint saved
        after validation holds this validation's metrics and best values."""
        if mode == "val":
            self.val_metrics = metrics
            self._track_best(metrics)
        else:
            self.test_metrics = metrics

    def _load_test_weights(self) -> None:
        """test_with=best: test the best checkpoint by the first monitored metric (model
        selection on validation, report on test); otherwise, or without one, the final weights."""
        path = next(iter(self.best_checkpoints.values()), None)
        distributed.barrier()  # rank 0 may still be writing the best checkpoint
        if self.settings.test_with == "best" and path and checkpoint_io.is_checkpoint(Path(path)):
            self._apply_checkpoint(checkpoint_io.load_checkpoint(path, "best checkpoint", consolidate=False),
                                   resume=False, source=Path(path), purpose="test")  # fmt: skip
            self.test_checkpoint: str | None = str(path)
        else:
            self.test_checkpoint = str(self.last_checkpoint) if self.last_checkpoint else None

    def _track_best(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            rule = self.directions.rule(key)
            if rule is None:  # nothing says which way is better: not tracked (monitored keys are checked at start-up)
                continue
            best = self.best_metrics.get(key)
            if better(value, None if best is None else best["value"], rule):
                self.best_metrics[key] = {"value": value, "epoch": self.epoch, "iter": self.iter, "rule": rule}

    def _check_metrics(self) -> None:
        """Every metric updated and computed once, on copies, with the first validation batch:
        a metric that does not fit the data (top_k=20 on 10 classes, a wrong num_classes)
        fails here, naming it, instead of after the first epoch. Leaves the run's random
        state and the metrics as they were."""
        loader = next(iter(self.val_loader.values())) if isinstance(self.val_loader, Mapping) else self.val_loader
        batch = next(iter(loader), None)  # type: ignore[arg-type]
        if batch is None or not self.metrics:
            return
        states, was_training = rng_states(), self.model.training
        try:
            self.model.eval()
            with torch.no_grad(), self.autocast():
                outputs = self.eval_step(self.to_device(batch))
            for name, slot in self.metrics.items():
                probe = copy.deepcopy(slot)
                probe.reset()
                try:
                    probe.update(outputs)
                    probe.compute()
                except ConfigError:
                    raise
                except Exception as exc:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise ConfigError(f"metrics.{name} ({type(slot.metric).__name__}) fails on the first validation "
                                      f"batch: {type(exc).__name__}: {first[:200]}. Check its settings against the data "
                                      f"(e.g. top_k, num_classes) and metrics.{name}.inputs") from None  # fmt: skip
        finally:
            self.model.train(was_training)
            set_rng_states(states)

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
        if self.device.type == "cpu" and not self.settings.channels_last:
            return batch
        return _move(batch, self.device, self.settings.channels_last)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
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
        inputs, targets = data_batch
        logits = self.model(inputs)
        return {"loss": self.criterion(logits, targets), "logits": logits, "targets": targets}

    # -- checkpoints --------------------------------------------------------------------------
    def state_checkpoint(self, save_optimizer: bool = True, save_scheduler: bool = True) -> dict[str, Any]:
        """Everything needed to continue this run exactly."""
        checkpoint: dict[str, Any] = {
            "meta": {
                "epoch": self.position[0],
                "iter": self.position[1],
                "inner_iter": self.position[2],
                "seed": self.settings.seed,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "work_dir": str(self.work_dir),
                "best_metrics": self.best_metrics,
                "val_metrics": self.val_metrics,  # the last validation's: result.json reports them after a resume
                "best_checkpoints": {k: Path(v).name for k, v in self.best_checkpoints.items()},  # beside this file
            },
            "config": self.config,
            "rng": rng_states(),
            "hooks": {name: state for name, _, hook in self._hooks if (state := hook.state_dict())},
        }
        if not self.sharded:  # (sharded: weights and optimizer state go to the shards, see save_checkpoint)
            checkpoint["state_dict"] = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            if save_optimizer and self.optimizers:
                if self._named_optimizers:
                    checkpoint["optimizers"] = {name: opt.state_dict() for name, opt in self.optimizers.items()}
                else:
                    checkpoint["optimizer"] = self.optimizer.state_dict()  # type: ignore[union-attr]
        if save_scheduler and self.schedulers:
            if self._named_optimizers:
                checkpoint["schedulers"] = {name: sched.state_dict() for name, sched in self.schedulers.items()}
            else:
                checkpoint["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            checkpoint["grad_scaler"] = self.scaler.state_dict()
        return checkpoint

    def save_checkpoint(
        self,
        path: Path,
        *,
        save_optimizer: bool = True,
        save_scheduler: bool = True,
        is_best: bool = False,
        metric: str | None = None,
        durable: bool = False,
    ) -> Path:
        """Write a checkpoint atomically (`durable`: fsync too); regular ones move `last_checkpoint`.
        With trainer.strategy=fsdp it is a sharded directory (``<name>.dcp``, every rank writes
        its shard). Returns the path written."""
        if self.sharded:
            path = path.with_name(self.checkpoint_name(path.name))
        elif not self.is_main:  # one writer: rank 0 (every rank holds the same weights)
            if not is_best:
                self.last_checkpoint = path
            return path
        checkpoint = self.state_checkpoint(save_optimizer, save_scheduler) if self.is_main else {}
        if self.is_main:
            self.call_hook(Stage.BEFORE_SAVE_CHECKPOINT, checkpoint=checkpoint)
        try:
            if self.sharded:
                from expkit import sharding

                optimizers = self.optimizers if save_optimizer else {}
                sharding.save(path, checkpoint, self.model, optimizers, durable=durable)
            else:
                checkpoint_io.save_atomic(checkpoint, path, durable=durable)
        except (OSError, RuntimeError) as exc:  # disk full (torch's zip writer raises RuntimeError), permissions, ...
            cause = (
                "no space left on the device"
                if _disk_full(exc)
                else f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            )
            kept = (f"the previous complete checkpoint {self.last_checkpoint} (and last_checkpoint) is intact"
                    if self.last_checkpoint else "no earlier checkpoint of this run exists")  # fmt: skip
            raise CheckpointWriteError(f"could not write {path}: {cause}; {kept}") from exc
        if not is_best:
            if self.is_main:
                checkpoint_io.point_last_checkpoint(path.parent, path)
            self.last_checkpoint = path
        if self.is_main:
            self.call_hook(Stage.AFTER_SAVE_CHECKPOINT, path=path, is_best=is_best, metric=metric)
        return path

    def checkpoint_name(self, name: str) -> str:
        """The name a checkpoint file name gets on disk: ``epoch_3.pth``, or with
        trainer.strategy=fsdp the sharded directory ``epoch_3.dcp``."""
        if not self.sharded:
            return name
        from expkit import sharding

        return sharding.checkpoint_name(name)

    def _load_or_resume(self) -> None:
        if self.resume_from is True or self.resume_from == "true":
            if self.is_main:  # what a killed writer left half-written is never read: remove it
                for directory in (self.work_dir, self.work_dir / "checkpoints"):
                    for name in checkpoint_io.remove_stale_temporaries(directory):
                        log.info("Removed %s, a temporary file left by an interrupted write", name)
            found = checkpoint_io.load_resumable(self.work_dir)
            if found is None:
                log.warning("resume=true: no checkpoint in %s/checkpoints yet; training from scratch", self.work_dir)
                return
            self._apply_checkpoint(found[1], resume=True, source=found[0])
        elif self.resume_from:
            path = Path(self.resume_from)
            self._apply_checkpoint(checkpoint_io.load_checkpoint(path, "resume", consolidate=False), resume=True,
                                   source=path)  # fmt: skip
        elif self.load_from:
            path = Path(self.load_from)
            self._apply_checkpoint(checkpoint_io.load_checkpoint(path, "load_from", consolidate=False), resume=False,
                                   source=path)  # fmt: skip

    @property
    def epoch_complete(self) -> bool:
        """True inside after_train_epoch when the epoch ran to its end (not cut short by a stop)."""
        return self.position[0] > self.epoch

    def _apply_checkpoint(self, checkpoint: dict[str, Any], *, resume: bool, source: Path, purpose: str = "") -> None:
        """Put a checkpoint's weights (and, to resume, the whole run state) in place.
        ``load_purpose`` tells hooks why: resume, load_from or test."""
        self.resuming = self.resuming or resume
        self.load_purpose = purpose or ("resume" if resume else "load_from")
        self.call_hook(Stage.AFTER_LOAD_CHECKPOINT, checkpoint=checkpoint)
        self._load_weights(checkpoint, source, resume)
        if not resume:
            log.info("Loaded weights from %s%s", source, " for the test" if purpose == "test" else "")
            return
        meta = checkpoint["meta"]
        self.epoch, self.iter, self.inner_iter = meta["epoch"], meta["iter"], meta.get("inner_iter", 0)
        self.position = (self.epoch, self.iter, self.inner_iter)
        self.best_metrics = dict(meta.get("best_metrics", {}))
        self.val_metrics = dict(meta.get("val_metrics", {}))
        # recorded paths name this run's own files: read them in the dir of the file resumed from
        self.best_checkpoints = {key: str(checkpoint_io.own_file(source.parent, path))
                                 for key, path in meta.get("best_checkpoints", {}).items()}  # fmt: skip
        if self.optimizer is not None and "optimizer" in checkpoint:
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        for name, state in checkpoint.get("optimizers", {}).items():
            if name in self.optimizers:
                self.optimizers[name].load_state_dict(state)
        if self.scheduler is not None and "scheduler" in checkpoint:
            self.scheduler.load_state_dict(checkpoint["scheduler"])
        for name, state in checkpoint.get("schedulers", {}).items():
            if name in self.schedulers:
                self.schedulers[name].load_state_dict(state)
        if self.scaler is not None and "grad_scaler" in checkpoint:
            self.scaler.load_state_dict(checkpoint["grad_scaler"])
        if "rng" in checkpoint:
            set_rng_states(checkpoint["rng"])
        for name, _, hook in self._hooks:
            if name in checkpoint.get("hooks", {}):
                hook.load_state_dict(checkpoint["hooks"][name])
        self.last_checkpoint = source
        log.info("Resumed from %s at epoch %d, iteration %d", source, self.epoch, self.iter)

    def _load_weights(self, checkpoint: dict[str, Any], source: Path, resume: bool) -> None:
        """The checkpoint's weights into the model (sharded or not); a sharded checkpoint's
        optimizer state too, to resume."""
        from expkit import sharding

        if "state_dict" not in checkpoint:  # a sharded checkpoint, read collectively
            sharding.load_into(
                Path(checkpoint["sharded"]["path"]), checkpoint, self.model, self.optimizers if resume else None
            )
            return
        state = {k.removeprefix("module."): v for k, v in checkpoint["state_dict"].items()}
        try:
            if sharding.is_sharded(self.model):
                if resume and ("optimizer" in checkpoint or "optimizers" in checkpoint):
                    raise ConfigError(f"resume={source}: a checkpoint file of an unsharded run cannot resume with "
                                      "trainer.strategy=fsdp (its optimizer state is not keyed by parameter name); "
                                      "resume it with trainer.strategy=ddp, or start from its weights with load_from=")  # fmt: skip
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            else:
                self.model.load_state_dict(state)
        except RuntimeError as exc:
            raise ConfigError(f"checkpoint {source} does not fit this model: {exc}") from None

    # -- result.json ------------------------------------------------------------------------------
    def _write_result(
        self,
        status: str,
        error: str | None,
        tb: str | None,
        wall_time: float,
        reserve: checkpoint_io.SpaceReserve | None = None,
    ) -> dict[str, Any]:
        result = {
            "status": status,
            "error": error,
            "stop_reason": self.stop_reason,
            "work_dir": str(self.work_dir.resolve()),
            "epoch": self.epoch,
            "iter": self.iter,
            "final_metrics": {**self.val_metrics, **self.test_metrics},
            "best_metrics": self.best_metrics,
            "monitor": self.monitor,
            "monitor_rule": self.directions.rule(self.monitor) if self.monitor else None,
            "best_checkpoint": next(iter(self.best_checkpoints.values()), None),
            "best_checkpoints": self.best_checkpoints,
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "test_checkpoint": self.test_checkpoint,
            "provenance": "provenance.json",  # commit, versions, packages, host, command, times
            "wall_time_s": round(wall_time, 3),
            **self.run_info,
            "traceback": tb,
        }
        if self.is_main or (
            status == "failed"
            and distributed.writes_for_the_group()
            and not _written_since(self.work_dir / "result.json", time.time() - wall_time)
        ):  # rank 0's own word wins
            write = reserve.write_json if reserve is not None else checkpoint_io.write_json_atomic
            files = [(self.work_dir / "result.json", result)]
            if self.is_main:  # (another rank writes only result.json, when rank 0 died)
                files.append((self.work_dir / "provenance.json", provenance.finish(self.provenance, status)))
            for path, content in files:
                try:
                    write(path, content)
                except OSError as exc:  # say so instead of hiding the run's own error under a traceback
                    log.error("Could not write %s: %s (the run's status: %s)", path,
                              "no space left on the device" if _disk_full(exc) else exc, status)  # fmt: skip
            if reserve is not None:
                reserve.release()
        return result


def _check_fsdp(model: nn.Module, hooks: Mapping[str, Hook] | Sequence[Hook],
                default_hooks: Mapping[str, Hook] | None) -> None:  # fmt: skip
    """trainer.strategy=fsdp: the model is sharded under torchrun, and every hook works with it."""
    from expkit import sharding

    if distributed.is_distributed() and not sharding.is_sharded(model):
        raise ConfigError("trainer.strategy=fsdp under torchrun needs the model sharded before its optimizer is built: "
                          "expkit.build does it; from Python, call expkit.sharding.shard(model, blocks, device) first")  # fmt: skip
    named = list(hooks.items()) if isinstance(hooks, Mapping) else [(type(h).__name__, h) for h in hooks]
    sharding.check_hooks(dict(named, **(default_hooks or {})))


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def _disk_full(exc: BaseException) -> bool:
    """ENOSPC, however it surfaced (an OSError, or torch's zip writer's RuntimeError)."""
    import errno

    return getattr(exc, "errno", None) == errno.ENOSPC or "unexpected pos" in str(exc) or "No space left" in str(exc)


def _check_hook_methods(hook: Hook, name: str) -> None:
    """Reject a misspelt stage (`after_train_itr`) or a stage method with a wrong signature."""
    for cls in type(hook).__mro__:
        if cls is Hook or cls is object:
            break
        for attr, value in vars(cls).items():
            if not callable(value) or attr.startswith("_"):
                continue
            if attr in _STAGE_NAMES:
                try:
                    inspect.signature(getattr(hook, attr)).bind(None, **{k: None for k in _PAYLOADS[attr]})
                except TypeError:
                    expected = ", ".join(["runner", *(f"{k}=..." for k in _PAYLOADS[attr])])
                    raise HookError(
                        type(hook).__name__, attr, f"wrong signature; the stage passes ({expected}) by keyword"
                    ) from None
            elif attr.startswith(("before_", "after_", "on_")):
                close = difflib.get_close_matches(attr, _STAGE_NAMES, n=1)
                hint = f"did you mean {close[0]}?" if close else f"stages are: {', '.join(s.value for s in Stage)}"
                raise HookError(type(hook).__name__, attr, f"{attr} is not a stage, so it would never run; {hint}")
