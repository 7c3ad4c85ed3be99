"""The train loop and the val/test loop: run -> run_epoch -> run_iter.

Hot-path rule: nothing here synchronises host and device per iteration (no ``.item()``);
hooks read values when they need them (the logger, at its interval).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.distributed import (
    STOP_NONE,
    STOP_REQUESTED,
    STOP_RESUMABLE,
    STOP_SIGNAL,
    agree_on_stop,
    all_reduce_sum,
    is_distributed,
    reduce_device,
)
from expkit.core.signals import stop_for_signal
from expkit.core.stages import Stage
from expkit.engine.hook_table import NULL
from expkit.engine.state import EpochStart, Position
from expkit.optimizers import Optimizers

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["EVAL_STAGES", "EvalLoop", "TrainLoop"]


log = logging.getLogger("expkit")

# the stages of an iteration as plain strings (an Enum member costs a Python-level lookup each time)
BEFORE_TRAIN_ITER, AFTER_FORWARD, AFTER_BACKWARD, AFTER_OPTIMIZER_STEP, AFTER_TRAIN_ITER = (
    Stage.BEFORE_TRAIN_ITER.value,
    Stage.AFTER_FORWARD.value,
    Stage.AFTER_BACKWARD.value,
    Stage.AFTER_OPTIMIZER_STEP.value,
    Stage.AFTER_TRAIN_ITER.value,
)


def _skip_batches(loader: Iterable, n: int, samples: int = 0) -> Iterable:
    """Resume mid-epoch: skip `n` batches by index when the sampler can, else by loading them.
    `samples`: after a resume with another number of processes, the samples of the epoch's
    order all processes trained on (the sampler skips those instead)."""
    sampler = getattr(loader, "sampler", None)
    if samples and hasattr(sampler, "skip_samples"):
        sampler.skip_samples(samples)  # type: ignore[attr-defined]
        return loader
    if samples:
        log.warning(
            "The sampler cannot skip %d samples of the epoch's order (it has no skip_samples): skipping "
            "%d batches of this process instead, which with another number of processes repeats or "
            "skips samples",
            samples,
            n,
        )
    if n and hasattr(sampler, "skip_batches"):
        sampler.skip_batches(n, loader.batch_size)  # type: ignore[attr-defined]
        return loader
    if n:
        log.info("Skipping %d already-trained batches by loading them (the sampler cannot skip by index)", n)
    return itertools.islice(loader, n, None)


def _timed_batches(batches: Iterable, runner: Runner) -> Iterator:
    """The same batches, each fetch inside the "data" phase (only when instrumented)."""
    iterator = iter(batches)
    while True:
        with runner.phase("data") as phase:
            batch = next(iterator, _END)
            # the fetch that finds the epoch's end is not a batch: its time is not data time (phase
            # is None when instrumentation was switched off mid-epoch)
            if batch is _END and phase is not None:
                phase.discard = True
        if batch is _END:
            return
        yield batch


_END = object()

# Position(epoch, iter, inner_iter) as the loop makes one each iteration: tuple.__new__ in C, not
# NamedTuple's generated __new__ (a Python frame an iteration)
_position = functools.partial(tuple.__new__, Position)


def _windows(batches: Iterator, k: int) -> Iterator[Sequence[Any]]:
    """Consecutive windows of `k` batches; the last one of an epoch may be shorter."""
    while window := list(itertools.islice(batches, k)):
        yield window


def _samples(batch: Any) -> int:
    """The number of samples in a batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        n = _samples(value)
        if n:
            return n
    return 0


class TrainLoop:
    """Epoch-based (``max_epochs``) or iteration-based (``max_iters``) training.

    Both run whole passes over the loader as epochs; an iteration budget may end the last
    one early. A stop request ends training after the current iteration.

    Args:
        runner: the run: its settings, train loader, model (through DDP when distributed),
            optimizers, grad scaler and hooks are read here; its state advances as the loop runs.
    """

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.settings = runner.settings
        self.loader = runner.train_loader
        # forward + loss: through DDP when distributed (gradients are averaged in backward), else
        # the model's own train_step when it has one; looked up once, not per iteration
        if runner.ddp_model is not None:
            self.step = runner.ddp_model
        else:
            self.step = runner.model.train_step if hasattr(runner.model, "train_step") else runner.train_step
        self.optimizers = Optimizers(runner.optimizers, runner.scaler, runner.settings.clip_grad_norm)
        # a model whose loss is a mean over tokens says how many a batch counts: accumulation weighs by them
        self.counted_tokens = getattr(runner.model, "counted_tokens", None)
        # the optimizer the loop steps: its first (a model that owns its update steps its own)
        self.only_optimizer = next(iter(runner.optimizers), "")
        self.distributed = is_distributed()
        # the logging steps (set by run(); 0: no hook reads runner.train_window)
        self.log_every, self.epoch_len, self.last_iter = 0, None, None
        # The last step's back-propagated loss, kept until the next step has made its own, as a
        # hand-written loop's `loss` variable is: while a graph that reaches a parameter lives, autograd
        # reuses the parameter's gradient accumulator node (a weak reference) instead of making and
        # freeing one per parameter every iteration (12 K instructions an iteration for 6 parameter
        # tensors, the GIL taken to free each). backward() freed the graph's saved tensors: its nodes
        # stay, with what a custom autograd.Function keeps on its ctx (ctx.x = ..., not
        # save_for_backward), as in a hand-written loop. Only a loss the loop back-propagated whole.
        self.held_graph: torch.Tensor | None = None
        self._bind()

    def _bind(self) -> None:
        """The forward (in the precision's autocast), backward and optimizer steps, each in its
        loop phase when the run is instrumented; otherwise, in fp32, the plain calls: the
        contexts would cost a dozen Python calls an iteration. Bound again when instrumentation
        is switched (the profiler does, mid-epoch)."""
        r = self.runner
        self.bound_for = r.instrumented
        # fp16: backward and step through the scaler
        scaled = r.scaler is not None
        self.forward = self._phased("forward", self.step, autocast=r.autocasts)
        self.backward = self._phased("backward", self.optimizers.backward if scaled else torch.Tensor.backward)
        step = self._scaled_step() if scaled else functools.partial(self.optimizers.step, self.only_optimizer)
        self.optimizer_step = self._phased("optimizer", step)
        # the common iteration, called in place (each Python frame costs 1-3 us an iteration among
        # the kernels' cache misses): one optimizer, one batch a step, no clipping or scaler, not
        # instrumented. Its hooks go through runner.call_hook like every other iteration's (a
        # subclass's override, a replacement or instrumentation sees them): only the forward,
        # backward and optimizer calls are inlined
        s = r.settings
        plain = not (
            r.instrumented
            or scaled
            or r.manual_optimization
            or s.clip_grad_norm is not None
            or s.accumulate_grad_batches != 1
        )
        self.plain_optimizer = r.optimizers.get(self.only_optimizer) if plain else None

    def _phased(self, name: str, fn: Callable[..., Any], autocast: bool = False) -> Callable[..., Any]:
        r = self.runner
        if not r.instrumented and not autocast:
            return fn

        def phased(*args: Any) -> Any:
            with r.phase(name), r.autocast() if autocast else NULL:
                return fn(*args)

        return phased

    def _scaled_step(self) -> Callable[[], None]:
        """With a scaler (fp16): clip, step through the scaler, zero_grad, update the scale. A
        function that does not hold the loop: a method of the loop kept on it would make a cycle
        that keeps the Runner (its model, optimizer state and loader workers) after the run until
        the garbage collector's next pass."""
        optimizers, only, scaler = self.optimizers, self.only_optimizer, self.runner.scaler
        assert scaler is not None

        def step() -> None:
            optimizers.step(only)
            scaler.update()

        return step

    def done(self) -> bool:
        """Whether training ends after this iteration: a stop request (agreed by every rank) or
        the budget."""
        r = self.runner
        if self.distributed:
            # Every rank stops after the same iteration: a rank that stopped alone would leave the
            # others waiting in their next collective (DDP's all-reduce in backward, FSDP's gather,
            # a sharded save) until the timeout. So each rank says what it has, and all take the
            # strongest (one 4-byte all-reduce on the CPU, after every iteration: see run_epoch).
            mine = STOP_NONE if r.stop_reason is None else STOP_RESUMABLE if r.stop_resumable else STOP_REQUESTED
            if r.stop_signal is not None:
                # the signal's number travels, so that a rank without it stops as if it had it
                mine = STOP_SIGNAL + r.stop_signal
            agreed = agree_on_stop(mine)
            if agreed >= STOP_SIGNAL and r.stop_signal is None:
                # a signal that reached another rank only (a kill of one PID): this rank records the
                # same kind of stop, so that rank 0's result.json says "signal", an unfinished run
                stop_for_signal(r, agreed - STOP_SIGNAL, " (on another rank)")
            if agreed != STOP_NONE:
                # a no-op when this rank asked first (the first request's reason is kept)
                resumable = agreed == STOP_RESUMABLE
                r.request_stop(
                    "interrupted on another rank" if resumable else "a stop on another rank", resumable=resumable
                )
                if resumable:
                    # an interruption on one rank (rank 0's time-limit guard) is one on every rank,
                    # whichever asked first: no rank tests (load_test_weights waits for all ranks)
                    r.stop_resumable = True
                return True
            # Decided by the agreed value only, never by this rank's own stop_reason: a signal that
            # lands after the all-reduce is this rank's alone until the next one, where all see it.
        elif r.stop_reason is not None:
            return True
        if self.settings.max_iters is not None:
            return r.state.iter >= self.settings.max_iters
        return r.state.epoch >= self.settings.max_epochs  # type: ignore[operator]

    def run(self) -> None:
        r = self.runner
        window = r.train_window
        window.iters = r.state.iter  # (a resumed run counts on from its checkpoint)
        window.losses.clear()  # (what an earlier training in this process left)
        window.logged.clear()
        r.call_hook(Stage.BEFORE_TRAIN)
        # logging steps: every log_every iterations of an epoch, its last and the run's last (the
        # logger's records); the hooks that run there only are not called in between
        self.log_every = r.hook_table.log_interval()
        known = r.settings.max_iters is not None or r.steps_per_epoch is not None
        self.last_iter = r.max_iters - 1 if self.log_every and known else None
        try:
            while not self.done():
                self.run_epoch()
        finally:
            self.held_graph = None  # (an exception's traceback keeps the loop)
        r.call_hook(Stage.AFTER_TRAIN)

    def run_epoch(self) -> None:
        r = self.runner
        s = r.state
        by_epoch = self.settings.by_epoch
        k = self.settings.accumulate_grad_batches
        # before skipping a resumed epoch's batches: DistSamplerSeedHook sets the epoch's order here
        r.call_hook(Stage.BEFORE_TRAIN_EPOCH)
        r.model.train()
        self.epoch_len = r.steps_per_epoch if self.log_every else None  # (as the logger counts it)
        # a window is k batches from the epoch's start: resumed after a part of one (the checkpoint
        # saved with another k), the windows start where the batches do, not at multiples of k
        if s.inner_iter % k:
            log.warning(
                "Resuming after %d batches of the epoch, not a multiple of accumulate_grad_batches=%d: "
                "this epoch's windows are shifted",
                s.inner_iter,
                k,
            )
        # resumed with another number of processes or batch size: skip by samples, not batches
        skip_samples = (s.epoch_start.samples and r.epoch_samples()) or 0
        batches = _skip_batches(self.loader, s.inner_iter, skip_samples)
        if s.epoch_start.samples and batches is self.loader and hasattr(self.loader, "__len__"):
            # the sampler skipped the samples: its length is the rest of the epoch, not all of it
            s.epoch_batches = s.inner_iter + len(self.loader)  # type: ignore[arg-type]
        if r.instrumented:
            batches = _timed_batches(batches, r)
        # k == 1: windows of one batch as zip's 1-tuples, made in C (no Python call a batch)
        windows = zip(batches) if k == 1 else _windows(iter(batches), k)
        # Asked after every iteration when something can end an epoch early: an iteration budget,
        # other ranks or a stop request (inside an epoch, an epoch budget cannot). Distributed, on
        # every rank alike: done() is a collective, and a rank that skipped it would hang the rest.
        every_iter = self.distributed or self.settings.max_iters is not None
        r.train_window.restart(time.perf_counter())  # the first batch's data time starts here
        for step_idx, window in enumerate(windows, start=s.inner_iter // k):
            self.run_iter(step_idx, window)
            if not by_epoch and r.validation_due(s.iter):
                r.validate()
                r.model.train()
            if (every_iter or s.stop_reason is not None) and self.done():
                break
        else:
            # the loader is exhausted: the epoch is complete, and a checkpoint saved in
            # after_train_epoch records the next one's start
            s.position = Position(s.epoch + 1, s.iter, 0)
            r.call_hook(Stage.AFTER_TRAIN_EPOCH)
            s.epoch += 1
            s.inner_iter = 0
            s.epoch_start, s.epoch_batches = EpochStart(0, 0), None
            if by_epoch and r.validation_due(s.epoch):
                r.validate()
            return
        # cut short by the budget or a stop request: the epoch is not counted (runner.epoch_complete is False)
        r.call_hook(Stage.AFTER_TRAIN_EPOCH)

    def run_iter(self, batch_idx: int, window: Sequence[Any]) -> None:
        """One iteration: one optimizer step over a window of micro-batches (one unless
        ``accumulate_grad_batches`` > 1). ``batch_idx`` is the step's index in the epoch."""
        r = self.runner
        s = r.state
        call = r.call_hook
        if r.instrumented is not self.bound_for:
            self._bind()
        # the stages no hook listens to are skipped; instrumented, every stage is called (and marked)
        idle = r.hook_table.idle if not r.instrumented else ()
        if r.moves_batches:
            window = [r.to_device(b) for b in window]
        # the data time ends here: one clock read, cheaper than a before_train_iter hook
        w = r.train_window
        s.batch_ready_s = ready = time.perf_counter()
        w.data_s += ready - w.end_s
        data_batch = window[0]
        if BEFORE_TRAIN_ITER not in idle:
            call(BEFORE_TRAIN_ITER, batch_idx=batch_idx, data_batch=data_batch)
        optimizer = self.plain_optimizer
        if optimizer is not None:
            # _forward_backward and Optimizers.step, in place (a window of one batch)
            outputs = self.forward(data_batch)
            if AFTER_FORWARD not in idle:
                call(AFTER_FORWARD, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
            loss = outputs["loss"]
            loss.backward()
            if AFTER_BACKWARD not in idle:
                call(AFTER_BACKWARD, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.held_graph = loss
        elif r.manual_optimization:
            outputs = self._owned_update(batch_idx, data_batch)
        else:
            if len(window) == 1:
                outputs, self.held_graph = self._forward_backward(batch_idx, data_batch, None, idle)
            else:
                outputs = self._accumulate(batch_idx, window, idle)
                data_batch = window[-1]
            self.optimizer_step()
        # The step is taken: a checkpoint saved from here on (by an after_train_iter hook) records
        # it as done, while runner.iter keeps its value until the hooks have run (MMEngine's
        # counters: after_train_iter sees the iteration's own index).
        consumed = s.inner_iter + len(window)
        s.position = _position((s.epoch, s.iter + 1, consumed))
        if AFTER_OPTIMIZER_STEP not in idle:
            call(AFTER_OPTIMIZER_STEP, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        every = self.log_every
        if every:  # what the hooks of the logging steps read of the iterations in between
            if (loss := outputs.get("loss")) is not None:  # (read at the logging step: no device sync here)
                w.losses.append(loss.detach())
            if logged := outputs.get("log"):  # a model's own scalars, detached (a dict the model reuses, a graph)
                w.logged.append(
                    (w.iters, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in logged.items()})
                )
        w.iters += 1
        log_step = every and (
            (batch_idx + 1) % every == 0 or batch_idx + 1 == self.epoch_len or s.iter == self.last_iter
        )
        if log_step:
            # the window ends here: what the logging step's hooks take (a record, a device sync, a
            # save) counts in the next one, as a timer called every iteration would count it
            w.step_s = time.perf_counter()
            with r.hook_table.log_step:  # every after_train_iter hook, those of logging steps included
                call(AFTER_TRAIN_ITER, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
            w.losses.clear()
            w.logged.clear()
        elif AFTER_TRAIN_ITER not in idle:
            call(AFTER_TRAIN_ITER, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        s.iter += 1
        s.inner_iter = consumed
        w.end_s = end = time.perf_counter()
        if log_step:
            w.restart(end, w.step_s)

    def _forward_backward(
        self, batch_idx: int, data_batch: Any, weight: float | None, idle: Container[str]
    ) -> tuple[dict[str, Any], Any]:
        """Forward, loss (times `weight`, a micro-batch's share of its window), backward (through
        the scaler); returns the outputs and the loss that was back-propagated. `idle`: the
        stages to skip (no hook there)."""
        call = self.runner.call_hook
        outputs = self.forward(data_batch)
        if AFTER_FORWARD not in idle:
            call(AFTER_FORWARD, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        loss = outputs["loss"] if weight is None else outputs["loss"] * weight
        self.backward(loss)
        if AFTER_BACKWARD not in idle:
            call(AFTER_BACKWARD, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        return outputs, loss

    def _owned_update(self, batch_idx: int, data_batch: Any) -> dict[str, Any]:
        """A model that owns its update does forward, backward and steps in its train_step;
        AFTER_FORWARD and AFTER_BACKWARD fire after it returns (its backward passes done)."""
        r, call = self.runner, self.runner.call_hook
        with r.phase("forward"), r.autocast():
            outputs = r.model.train_step(data_batch, self.optimizers)
        call(AFTER_FORWARD, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        call(AFTER_BACKWARD, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
        if r.scaler is not None:
            # once per iteration, after every step the model took: the scale moves once a step
            r.scaler.update()
        self.optimizers.zero_grad()
        return outputs

    def _accumulate(self, batch_idx: int, window: Sequence[Any], idle: Container[str]) -> dict[str, Any]:
        """Gradient accumulation, exact: each micro-batch's (mean) loss is weighted by its share
        of the window's samples, or of its counted tokens when the model's loss is a mean over
        tokens (its ``counted_tokens(batch)``: a causal LM, padded batches), so the summed
        gradient is that of one batch of all of them, the shorter last window of an epoch
        included. Under DDP (FSDP), gradients are all-reduced (reduce-scattered) once, in the
        backward of the last micro-batch, and each process's window counts alike. Returns the
        last micro-batch's outputs with ``loss`` the window's loss."""
        self.held_graph = None  # (each micro-batch's graph is let go: an epoch's last window of one held one)
        counted = self.counted_tokens
        # Each micro-batch's loss is a mean over its own samples (tokens). Backward adds the
        # gradients up, so weighting each mean by its share of the window's samples makes the sum
        # the gradient of the mean over all of them, as one batch of the window would give; an
        # equal 1/k weight would not, once micro-batches differ in size (an epoch's last, padding).
        # A token count stays a tensor on the device: dividing by the window's sum waits for nothing.
        tokens = [counted(b) for b in window] if counted is not None else [None]
        sizes = tokens if tokens[0] is not None else [_samples(b) for b in window]
        total = sum(sizes)
        ddp = self.runner.ddp_model
        fsdp = self.runner.model if hasattr(self.runner.model, "set_requires_gradient_sync") else None
        window_loss = None
        for i, (micro, size) in enumerate(zip(window, sizes)):
            last = i == len(window) - 1
            # Gradients are averaged over the processes once a step, in the last micro-batch's
            # backward (one all-reduce, or FSDP2's reduce-scatter, instead of k): before it, each
            # process only adds to its own gradients. The average is linear, so averaging the sum
            # once gives what averaging each micro-batch's would; it weighs every process alike.
            if fsdp is not None:
                fsdp.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():
                outputs, share = self._forward_backward(batch_idx, micro, size / total, idle)
            # the window's loss is reported, not back-propagated: detached, it holds no graph
            share = share.detach()
            window_loss = share if window_loss is None else window_loss + share
        return {**outputs, "loss": window_loss}


# a val or test pass's stages by role, as plain strings
EVAL_STAGES = {
    mode: {
        role: Stage(f"{when}_{mode}{suffix}").value
        for role, when, suffix in [
            ("begin", "before", ""),
            ("begin_epoch", "before", "_epoch"),
            ("before_iter", "before", "_iter"),
            ("after_iter", "after", "_iter"),
            ("end_epoch", "after", "_epoch"),
            ("end", "after", ""),
        ]
    }
    for mode in ("val", "test")
}


class EvalLoop:
    """One pass over a val or test loader; returns ``{"val/loss": ..., "val/acc": ...}``.

    A mapping of named loaders (several validation sets) is one validation: each set in turn
    (``runner.eval_set`` names it while its batches run), reported as ``val/<set>/<metric>``,
    and the hooks' epoch-level stages see all of them at once.

    Args:
        runner: the run whose model, eval step, metrics and hooks the pass uses.
        loader: the batches, or a mapping of set names to loaders (several validation sets).
        mode: ``val`` or ``test``: the hook stages called and the prefix of the metric keys.
    """

    def __init__(self, runner: Runner, loader: Iterable | Mapping[str, Iterable], mode: str) -> None:
        self.runner = runner
        self.loader = loader
        self.mode = mode
        self.stages = EVAL_STAGES[mode]
        # looked up again for each set, after the begin hooks (which may swap the model)
        self.eval_step = self.step = runner.eval_step
        self.idle: Container[str] = ()

    @staticmethod
    def _in_autocast(eval_step: Callable[[Any], dict[str, Any]], runner: Runner) -> Callable[[Any], dict[str, Any]]:
        """`eval_step` in the precision's autocast; a function that does not hold the loop (a method
        of the loop kept on it would make a cycle that keeps the Runner until the garbage collector's
        next pass)."""
        autocast = runner.autocast

        def step(batch: Any) -> dict[str, Any]:
            with autocast():
                return eval_step(batch)

        return step

    def run(self) -> dict[str, float]:
        r, stages = self.runner, self.stages
        r.call_hook(stages["begin"])
        r.call_hook(stages["begin_epoch"])
        was_training = r.model.training
        r.model.eval()
        sets = self.loader.items() if isinstance(self.loader, Mapping) else [(None, self.loader)]
        metrics: dict[str, float] = {}
        for name, loader in sets:
            r.eval_set = name
            metrics.update(self.run_set(loader, f"{self.mode}/{name}" if name else self.mode))
        r.eval_set = None
        r.model.train(was_training)
        r.record_eval(self.mode, metrics)
        r.call_hook(stages["end_epoch"], metrics=metrics)
        r.call_hook(stages["end"])
        return metrics

    def run_set(self, loader: Iterable, prefix: str) -> dict[str, float]:
        """The loss and every metric over one loader, as ``<prefix>/<name>``."""
        r = self.runner
        for metric in r.metrics.values():
            metric.reset()
        # summed on the device, one sync at the end; on the CPU, where reading a value syncs
        # nothing, as a Python float (cheaper than the three tensor operations per batch)
        self.loss_sum: torch.Tensor | float = 0.0 if r.device.type == "cpu" else torch.zeros((), device=r.device)
        self.count = 0
        # the stages no hook listens to are skipped; instrumented, every stage is called (and marked)
        self.idle = r.hook_table.idle if not r.instrumented else ()
        # a before_val hook may have swapped the model (EMA weights): its step is looked up now
        self.eval_step = r.eval_step_function()
        self.step = self._in_autocast(self.eval_step, r) if r.autocasts else self.eval_step
        with torch.no_grad():
            missing = self._missing_forwards(loader) if r.sharded and is_distributed() else 0
            data_batch = None
            for batch_idx, data_batch in enumerate(loader):
                self.run_iter(batch_idx, data_batch)
            # FSDP2: as many forwards as the rank with the most batches; their outputs are not used
            if missing:
                batch = r.to_device(data_batch)
                for _ in range(missing):
                    self.step(batch)
        # every rank evaluated its own share: add them up
        if is_distributed():
            totals = torch.tensor(
                [float(self.loss_sum), float(self.count)], dtype=torch.float64, device=reduce_device()
            )
            all_reduce_sum(totals)
            self.loss_sum, self.count = totals[0], int(totals[1])
            for metric in r.metrics.values():
                metric.sync()
        metrics = {f"{prefix}/loss": float(self.loss_sum / max(self.count, 1))}
        # Python floats; a metric whose result is a dict gives <name>/<key>
        for name, metric in r.metrics.items():
            metrics.update({f"{prefix}/{name}{suffix}": value for suffix, value in metric.compute().items()})
        return metrics

    def _missing_forwards(self, loader: Iterable) -> int:
        """FSDP2: every forward gathers parameters from all ranks, so every rank must run as many
        as the others. A rank with fewer batches (uneven shares of a set) runs its last batch
        again that many times; told before the pass, as a collective between forwards would
        deadlock with another rank's gather."""
        from expkit.core.errors import ConfigError

        if not hasattr(loader, "__len__"):
            raise ConfigError(
                f"{self.mode}: with trainer.strategy=fsdp the evaluation loaders need a length "
                "(every rank must run as many forward passes)"
            )
        batches = len(loader)  # type: ignore[arg-type]
        most = torch.tensor([batches], dtype=torch.int64, device=reduce_device())
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        if int(most) > batches == 0:
            raise ConfigError(
                f"{self.mode}: this rank's share of the data is empty while others have batches; "
                "use fewer processes or a larger set"
            )
        return int(most) - batches

    def run_iter(self, batch_idx: int, data_batch: Any) -> None:
        r, stages, idle = self.runner, self.stages, self.idle
        if r.moves_batches:
            data_batch = r.to_device(data_batch)
        if stages["before_iter"] not in idle:
            r.call_hook(stages["before_iter"], batch_idx=batch_idx, data_batch=data_batch)
        outputs = self.step(data_batch)
        targets = outputs["targets"]
        n = len(targets)
        loss = outputs.get("loss")
        if loss is not None:
            if isinstance(self.loss_sum, float):
                self.loss_sum += loss.item() * n
            else:
                self.loss_sum += loss.detach().float() * n
        self.count += n
        # each metric reads the outputs it is configured for (default: preds or logits, and targets)
        for metric in r.metrics.values():
            metric.update(outputs)
        if stages["after_iter"] not in idle:
            r.call_hook(stages["after_iter"], batch_idx=batch_idx, data_batch=data_batch, outputs=outputs)
