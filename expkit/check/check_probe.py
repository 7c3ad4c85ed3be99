"""The probe's traces: the hook ``python -m expkit.check`` adds to each run it starts, which
writes what every iteration saw and did to ``<work dir>/check_probe.jsonl`` as it goes, and
``expkit.check.traces`` reads such a file back, so two runs can be compared line by line
afterwards (``expkit.check.comparison``), even when one of them is killed.

Per iteration: a fingerprint of the batch as a whole and of each sample in it (per tensor), the
loss bit for bit, and a checksum of the parameters after the step. Per validation: the metrics
bit for bit. At the start: what the train loader is made of (sampler, workers, generator). At
the end: the RNG streams and every hook's and metric's attributes, fingerprinted. It also ends
the run at the check's budget (a stop request, as ``stop_after`` makes) and, when told by the
environment, kills its own process with SIGKILL right after the checkpoint it waits for.

Nothing here is meant for a user's config: the check adds it, with its lowest priority, so
that it sees each iteration after every other hook (the checkpoint hook included).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from expkit.check.traces import KILL_AT_ENV, records_name
from expkit.core.stages import Priority
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = [
    "CheckProbe",
    "attributes",
    "digest",
    "fingerprint",
    "loader_facts",
    "tensor_digest",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's own shard; any other tensor as it is."""
    return t.to_local() if callable(getattr(t, "to_local", None)) else t


def digest(data: bytes) -> str:
    """A short digest of `data`: BLAKE2b of 8 bytes.

    Args:
        data: the bytes to digest.

    Returns:
        The digest as 16 hex digits.
    """
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's bytes and shape; floating-point values by their bits, a sharded
    (DTensor) tensor by this process's shard.

    Args:
        t: the tensor, on any device.

    Returns:
        The digest as 16 hex digits.
    """
    t = _local(t.detach())
    if t.is_floating_point() or t.is_complex():  # (bfloat16 has no NumPy view: compare its bits)
        t = t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return digest(t.cpu().contiguous().numpy().tobytes() + str(tuple(t.shape)).encode())


def fingerprint(value: Any, depth: int = 0) -> Any:
    """A JSON value that is equal for equal values: tensors by their bytes, numbers exactly
    (floats as hex), containers element by element; objects of other kinds by their state
    where they have one (a module's state_dict), else by type only (None: not compared).

    Args:
        value: the value to fingerprint.
        depth: how deep `value` is nested in the value fingerprinted first; a value nested
            more than 6 levels deep is not compared (None).

    Returns:
        A JSON value: ``t:<digest>`` for a tensor, ``a:<digest>`` for a NumPy array or scalar,
            a float's hex form, other scalars as they are, lists and dicts of fingerprints; None
            for what is not compared.
    """
    if depth > 6:
        return None
    if isinstance(value, torch.Tensor):
        return "t:" + tensor_digest(value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float.hex(value)
    if isinstance(value, (list, tuple)):
        return [fingerprint(v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        return {str(k): fingerprint(v, depth + 1) for k, v in value.items()}
    if isinstance(value, torch.nn.Module):
        return fingerprint(value.state_dict(), depth + 1)
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):  # a NumPy array or scalar
        return "a:" + digest(value.tobytes())
    return None


def attributes(obj: Any) -> dict[str, Any]:
    """An object's own attributes (``vars``), fingerprinted; those that cannot be compared
    (files, locks, the runner, callables) are left out.

    Args:
        obj: the object (a hook, a metric).

    Returns:
        The fingerprint of each attribute that has one, by name.
    """
    out = {}
    for name, value in vars(obj).items():
        if callable(value) and not isinstance(value, torch.nn.Module):
            continue
        fp = fingerprint(value)
        if fp is not None:
            out[name] = fp
    return out


def _samples(batch: Any) -> list[list[str]]:
    """Per tensor of the batch (in the order they are found), one short digest per sample."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(batch)
    return [[tensor_digest(row)[:8] for row in t] if t.dim() else [tensor_digest(t)[:8]] for t in tensors]


def _loss(outputs: Any) -> str | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float.hex(float(loss.detach().float()))
    return None


def _params_checksum(model: torch.nn.Module) -> str:
    """This process's parameters (its shards under FSDP2), summed each."""
    sums = [_local(p.detach()).double().sum() for p in model.parameters()]
    return tensor_digest(torch.stack(sums)) if sums else ""


def loader_facts(loader: Any) -> dict[str, Any]:
    """What the train loader's order and randomness come from.

    Args:
        loader: the train loader (a DataLoader, or any object with the same attributes).

    Returns:
        The loader's class and its dataset's qualified name; its sampler (or custom batch
            sampler): its qualified name and whether it has ``set_epoch``, ``state_dict`` and a
            start to skip to; the number of workers, whether it has a generator, its
            ``worker_init_fn``'s name, and whether its workers persist.
    """
    facts: dict[str, Any] = {"class": type(loader).__name__}
    # a finding about the data names the dataset, as the others name their hook or metric
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        facts["dataset"] = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    custom_batches = batch_sampler is not None and type(batch_sampler).__name__ != "BatchSampler"
    order = batch_sampler if custom_batches else sampler
    if order is not None:
        facts["sampler"] = f"{type(order).__module__}.{type(order).__qualname__}"
        facts["sampler_name"] = type(order).__name__
        facts["set_epoch"] = callable(getattr(order, "set_epoch", None))
        facts["state_dict"] = callable(getattr(order, "state_dict", None))
        facts["skips_by_index"] = callable(getattr(order, "set_start", None)) or hasattr(order, "start")
    facts["num_workers"] = int(getattr(loader, "num_workers", 0) or 0)
    facts["generator"] = getattr(loader, "generator", None) is not None
    facts["worker_init_fn"] = getattr(getattr(loader, "worker_init_fn", None), "__qualname__", None)
    facts["persistent_workers"] = bool(getattr(loader, "persistent_workers", False))
    return facts


class CheckProbe(Hook):
    """See the module. ``stop_at``: the number of iterations the check trains.

    The iteration to die after is read from the environment (``KILL_AT_ENV``).

    Args:
        stop_at: the number of iterations the check trains; the run is asked to stop there.
    """

    priority = Priority.LOWEST

    def __init__(self, stop_at: int) -> None:
        self.stop_at = int(stop_at)
        kill = os.environ.get(KILL_AT_ENV, "")
        self.kill_at = int(kill) if kill.isdigit() else None
        self._file: Any = None
        self.rank = 0

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def before_run(self, runner: Runner) -> None:
        from expkit.core import distributed

        self.rank = distributed.rank()
        self._file = open(Path(runner.work_dir) / records_name(self.rank), "a", buffering=1)  # noqa: SIM115  (closed in after_run)
        if not torch.are_deterministic_algorithms_enabled():  # (trainer.deterministic=true raises instead)
            torch.use_deterministic_algorithms(True, warn_only=True)  # ops without one are named on stderr

    def before_train(self, runner: Runner) -> None:
        self._write(
            {
                "event": "start",
                "iter": runner.iter,
                "epoch": runner.epoch,
                "resumed": runner.resuming,
                "steps_per_epoch": runner.steps_per_epoch,
                "loader": loader_facts(runner.train_loader),
            }
        )

    def after_train_iter(self, runner: Runner, *, batch_idx: int, data_batch: Any, outputs: dict[str, Any]) -> None:
        model = runner.model
        self._write(
            {
                "event": "iter",
                "iter": runner.iter,
                "epoch": runner.epoch,
                "batch_idx": batch_idx,
                "samples": _samples(data_batch),
                "loss": _loss(outputs),
                "params": _params_checksum(model) if isinstance(model, torch.nn.Module) else None,
            }
        )
        done = runner.iter + 1
        if done >= self.stop_at:
            runner.request_stop(f"expkit.check: {self.stop_at} iterations")
        if self.kill_at is not None and done >= self.kill_at:
            self._kill_once_saved(runner)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._write(
            {
                "event": "val",
                "iter": runner.iter,
                "set": runner.eval_set,
                "metrics": {k: fingerprint(float(v)) for k, v in metrics.items()},
            }
        )

    def after_test_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        self._write(
            {
                "event": "test",
                "iter": runner.iter,
                "set": runner.eval_set,
                "metrics": {k: fingerprint(float(v)) for k, v in metrics.items()},
            }
        )

    def after_val(self, runner: Runner) -> None:
        if self.kill_at is not None and runner.iter >= self.kill_at:
            self._kill_once_saved(runner)  # (a save due at a validation waits for it)

    def _kill_once_saved(self, runner: Runner) -> None:
        if self.rank != 0:  # (under torchrun, rank 0 dies; torchrun then stops the others, as when a node is lost)
            return
        pointer = Path(runner.work_dir) / "checkpoints" / "last_checkpoint"
        try:
            saved = Path(pointer.read_text().strip()).stem
        except OSError:
            return
        if saved.split("_")[-1] == str(self.kill_at):
            self._write({"event": "killed", "iter": runner.iter})
            self._file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def after_train(self, runner: Runner) -> None:
        import numpy as np

        hooks = {}
        for name, hook in zip(runner.hook_names(), runner.hooks, strict=True):
            if hook is self:
                continue
            own_state = type(hook).state_dict is not Hook.state_dict
            hooks[name] = {
                "class": f"{type(hook).__module__}.{type(hook).__qualname__}",
                "state_dict": own_state,
                "attrs": attributes(hook),
            }
        metrics = {
            name: {"class": type(slot.metric).__name__, "attrs": attributes(slot.metric)}
            for name, slot in runner.metrics.items()
        }
        rng = {
            "torch": tensor_digest(torch.get_rng_state()),
            "python": digest(repr(random.getstate()).encode()),
            "numpy": digest(repr(np.random.get_state()).encode()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = digest(b"".join(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()))
        self._write({"event": "end", "iter": runner.iter, "hooks": hooks, "metrics": metrics, "rng": rng})

    def after_run(self, runner: Runner) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
