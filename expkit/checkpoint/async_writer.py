"""Asynchronous checkpoint saves (``default_hooks.checkpoint.async_save=true``).

The training loop waits only while the checkpoint's tensors are copied into host buffers (kept
and reused from one save to the next); serialising and writing the file, moving the
``last_checkpoint`` pointer and the retention that follows run in one background thread. At
most one save is in flight: the next one waits for it (and says so once). A write that fails
leaves the previous checkpoint the latest (the pointer moves only after the file is complete),
and its error is raised in the training loop at the next save or at the end of training.

The copy is what a save costs the loop: for 25M parameters with AdamW's state (300 MB) about
25 ms here, against about 0.3 s for the synchronous ``torch.save`` (``benchmarks/ckpt_stall.py``).

From GPU memory the loop waits for less: the copies to pinned host memory are queued on a CUDA
stream of their own, behind the work already queued (the step that made these weights), and the
training's stream waits for them on the GPU, not on the host, before it changes a weight; the
writer's thread waits for them (a CUDA event) before it reads the buffers. The loop pays for
queueing the copies, not for the step still running nor for the transfer. (On an H200,
2026-11-28, with ``torch.cuda.synchronize()`` after the copies instead, the stall was 91-156 ms
against 275-330 ms for a synchronous save of ResNet-50 + AdamW: 0.33x.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["BackgroundWriter"]


log = logging.getLogger("expkit")

_IMMUTABLE = (str, int, float, bool, bytes, type(None), torch.dtype, torch.device)


class _Write:
    """One background write: the job, what follows it in the writer's thread (retention), and
    what follows it on the training thread (hooks' after_save_checkpoint)."""

    def __init__(self, write: Callable[[], None], then: Callable[[], None] | None, position: Any) -> None:
        self.write, self.then, self.position = write, then, position
        self.after: list[Callable[[], None]] = []
        self.open = True  # still takes steps to follow it
        self.future: Future | None = None
        self.ready: list[Any] = []  # CUDA events: the staging copies complete (waited for before `write`)


class BackgroundWriter:
    """One background thread for a run's checkpoint writes, and the host buffers they are staged
    in: a set per kind of save (``regular``, ``best``), so that the best checkpoint and the
    regular one saved after the same validation are written one after the other without the
    loop waiting between them. One save of each kind is in flight at a time.

    Args:
        shards: for sharded checkpoints (``trainer.strategy=fsdp``), the run's
            ``expkit.checkpoint.dcp.AsyncShards``: it writes the shards, and ``wait`` has the ranks
            agree through it on whether each write completed everywhere. None: unsharded saves only.
    """

    def __init__(self, shards: Any = None) -> None:
        self.shards = shards
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._writes: dict[str, _Write] = {}  # in flight, by kind
        self._last: _Write | None = None  # the newest write: what `after` attaches to
        self._buffers: dict[str, dict[tuple, torch.Tensor]] = {}
        self._streams: dict[torch.device, Any] = {}  # a CUDA stream per device for the staging copies
        self._ready: dict[str, list[Any]] = {}  # by kind: events of copies staged, not yet submitted
        self._told = False
        self.waited_s = 0.0  # time the loop spent waiting for a previous write (benchmarks read it)

    # -- staging --------------------------------------------------------------------------------
    def stage(self, checkpoint: Any, kind: str = "regular", *, complete: bool = True) -> Any:
        """A copy of `checkpoint` that training cannot change: every tensor copied into a host
        buffer of this kind (reused at the next save when its path, shape and dtype match),
        containers copied, other objects deep-copied. The previous write of this kind must be
        waited for: its buffers are the ones reused.

        `complete`: the copies from GPU memory are complete when this returns (the caller reads
        the buffers, or hands them to a thread that does not wait). False: they are queued on a
        staging stream, and the next ``submit`` of this `kind` waits for them in the writer's
        thread before its write; the training's stream waits for them on the GPU."""
        import copy

        assert kind not in self._writes, f"a {kind} save is in flight: wait({kind!r}) first"
        buffers = self._buffers.setdefault(kind, {})
        seen: dict[int, torch.Tensor] = {}  # a tensor under two keys (tied weights) stays one tensor
        cuda = False
        staging: dict[torch.device, Any] = {}  # the devices whose copies went to a staging stream

        def walk(obj: Any, path: tuple) -> Any:
            nonlocal cuda
            if isinstance(obj, torch.Tensor) and type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
                # a tensor subclass that wraps tensors (FSDP2's DTensor: this rank's shard, its placement):
                # the wrapped tensors staged, the wrapper rebuilt around them (torch's subclass protocol)
                if id(obj) not in seen:
                    names, context = obj.__tensor_flatten__()
                    inner = {
                        n: walk(v, (*path, n)) if isinstance(v := getattr(obj, n), torch.Tensor) else v for n in names
                    }  # (DTensor names its device mesh too: kept as it is)
                    seen[id(obj)] = type(obj).__tensor_unflatten__(inner, context, obj.shape, obj.stride())
                return seen[id(obj)]
            if isinstance(obj, torch.Tensor):
                if id(obj) in seen:
                    return seen[id(obj)]
                buffer = buffers.get(path)
                if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                    pin = obj.is_cuda and torch.cuda.is_available()
                    buffer = buffers[path] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=pin)
                if obj.is_cuda and not complete:
                    with torch.cuda.stream(self._staging_stream(obj.device, staging)):
                        buffer.copy_(obj.detach(), non_blocking=True)
                else:
                    buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
                cuda = cuda or obj.is_cuda
                seen[id(obj)] = buffer
                return buffer
            if isinstance(obj, dict):
                out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
                out.update((k, walk(v, (*path, k))) for k, v in obj.items())
                if hasattr(obj, "_metadata"):  # (a module's state_dict: its version numbers, as torch.save keeps them)
                    out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
                return out
            if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
                return type(obj)(walk(v, (*path, i)) for i, v in enumerate(obj))
            return obj if isinstance(obj, _IMMUTABLE) else copy.deepcopy(obj)

        staged = walk(checkpoint, ())
        if staging:
            # the training's stream goes on only after the copies (a wait on the GPU: the loop does not
            # stop), so no later step changes a tensor before it is copied, nor reuses the memory of one
            # freed meanwhile; the writer's thread waits for the event before it reads the buffers
            events = self._ready.setdefault(kind, [])
            for device, stream in staging.items():
                event = torch.cuda.Event()
                event.record(stream)
                torch.cuda.current_stream(device).wait_stream(stream)
                events.append(event)
        elif cuda:  # the copies to pinned memory were queued: complete before the caller reads them
            torch.cuda.synchronize()
        return staged

    def _staging_stream(self, device: torch.device, staging: dict[torch.device, Any]) -> Any:
        """The staging stream of `device`, made to wait, the first time this save copies from that
        device, for the work queued so far on the training's stream (what made the tensors)."""
        if device not in staging:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            staging[device] = stream
        return staging[device]

    # -- writing --------------------------------------------------------------------------------
    def submit(
        self,
        write: Callable[[], None],
        then: Callable[[], None] | None = None,
        *,
        kind: str = "regular",
        position: Any = None,
    ) -> None:
        """Run `write` in the background, after the writes queued before it; `then` runs on the
        caller's thread once it succeeded (at the next ``wait`` for it). `position`: where
        training was (a later save that has to wait for this one says so, once)."""
        assert kind not in self._writes, f"a {kind} save is in flight: wait({kind!r}) first"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expkit-checkpoint")
        job = _Write(write, then, position)
        job.ready = self._ready.pop(kind, [])
        job.future = self._pool.submit(self._run, job)
        self._writes[kind] = self._last = job

    def _run(self, job: _Write) -> None:
        try:
            for event in job.ready:  # the staging copies from GPU memory (stage(complete=False))
                event.synchronize()
            job.write()
        except BaseException:
            with self._lock:  # what was to follow a failed write never runs
                job.open, job.after = False, []
            raise
        while True:  # what was asked to follow this write, in order, including what is asked meanwhile
            with self._lock:
                if not job.after:
                    job.open = False
                    return
                step = job.after.pop(0)
            try:
                step()  # (an upload that fails fails the save: the steps after it, retention, never run)
            except BaseException:
                with self._lock:
                    job.open, job.after = False, []
                raise

    def after(self, step: Callable[[], None]) -> None:
        """Run `step` (deleting what the new checkpoint replaces) once the newest write is
        complete, in the writer's thread; at once when nothing is in flight; never when that
        write failed."""
        job = self._last
        if job is not None:
            with self._lock:
                if job.open:
                    job.after.append(step)
                    return
            if job.future.exception() is not None:  # type: ignore[union-attr]
                return
        step()

    def wait(self, kind: str | None = None, *, position: Any = None, why: str = "", agree: bool = True) -> None:
        """Wait for the write of this `kind` in flight (None: every write); raise its error (a
        CheckpointWriteError, as a synchronous save would have); then run what was to follow it
        on this thread. `why`, `position`: said once, the first time the loop waits for a write
        from an earlier position that is still going on. Sharded checkpoints: every rank waits
        for the same writes in the same order, and (`agree`) the ranks then agree on whether each
        was complete everywhere: a collective, off on the paths a failure takes."""
        kinds = list(self._writes) if kind is None else [kind] if kind in self._writes else []
        for k in kinds:
            job = self._writes.pop(k)
            if job is self._last:
                self._last = None
            future = job.future
            assert future is not None
            if why and not future.done() and job.position != position and not self._told:
                self._told = True
                log.info(
                    "Waiting for the previous checkpoint to be written before %s: saves come faster than "
                    "they are written (async_save keeps one in flight; said once)",
                    why,
                )
            started = time.perf_counter()
            error = future.exception()  # (waits)
            self.waited_s += time.perf_counter() - started
            if self.shards is not None and agree:
                error = self.shards.agree(error)
            if error is not None:
                raise error
            if job.then is not None:
                job.then()

    def close(self) -> None:
        """Wait for every write in flight (an error is logged, not raised) and stop the thread."""
        while self._writes:
            try:
                self.wait(next(iter(self._writes)), agree=False)
            except Exception as exc:
                log.error("A checkpoint write failed: %s", exc)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
