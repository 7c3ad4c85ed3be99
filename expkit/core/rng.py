"""Seeding, random-generator states (saved in checkpoints) and deterministic mode."""

from __future__ import annotations

import array
import binascii
import contextlib
import ctypes
import logging
import random
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "algorithm_settings",
    "flush_denormals",
    "flushing_denormals",
    "rng_states",
    "seed_everything",
    "set_deterministic",
    "set_rng_states",
]

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices).

    Args:
        seed: the seed; NumPy gets it modulo 2**32.
    """
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic() -> None:
    """torch's deterministic algorithms and settings (an error names any op without one)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by deterministic cuBLAS
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def algorithm_settings(deterministic: bool, cudnn_benchmark: bool, flush_denormal: bool = False) -> Iterator[None]:
    """A run's ``trainer.deterministic`` / ``trainer.cudnn_benchmark`` (fixed input shapes:
    cuDNN times its kernels once, then reuses the fastest), put back as they were afterwards.

    Args:
        deterministic: turn on torch's deterministic algorithms and cuDNN's deterministic mode (and
            turn cuDNN's benchmark off).
        cudnn_benchmark: turn on cuDNN's benchmark mode; ignored when `deterministic` is set.
        flush_denormal: flush denormal floats to zero on the CPU (``torch.set_flush_denormal``), in
            this thread and the threads it starts from here on.

    Yields:
        None, with the settings in force; they are put back on exit (the
        ``CUBLAS_WORKSPACE_CONFIG`` that deterministic mode sets stays).
    """
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    if deterministic:
        set_deterministic()
    elif cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    try:
        with flush_denormals(flush_denormal):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


# torch's intra-op threads flush denormals since a run with trainer.flush_denormal=true started them
# (a thread keeps the floating-point state it started with): a later run in this process is told
_left_flushing: set[str] = set()  # {"threads"} once it happened


@contextlib.contextmanager
def flush_denormals(on: bool) -> Iterator[None]:
    """``trainer.flush_denormal``: with `on`, the CPU reads and writes denormal floats as zero
    (``torch.set_flush_denormal``) until the context ends, in this thread and the threads started
    while it is on. A thread takes its creator's floating-point state when it starts and keeps
    it: torch's intra-op threads started before keep computing on denormals (a warning), and
    those started meanwhile go on flushing after it (an info line; a later run in this process
    without the setting gets a warning). ``python -m expkit.train`` and ``expkit.lr_find`` enter
    this before they build anything. Already on (the caller's own): left on.

    Args:
        on: flush; False only warns when an earlier run left torch's threads flushing.

    Yields:
        None, with denormals flushed when `on`.
    """
    if not on:
        if _left_flushing and (flushed := _intra_op_share(flushing=True)):  # (asked only after a flushing run)
            log.warning(
                "trainer.flush_denormal=false, but torch's intra-op threads started during an earlier run in this "
                "process with trainer.flush_denormal=true still flush denormals to zero, %.0f%% of a parallel "
                "operation's work; to keep them apart, run each job in its own process (e.g. "
                "hydra/launcher=submitit_local)",
                100 * flushed,
            )
        yield
        return
    if flushing_denormals():
        yield
        return
    if not torch.set_flush_denormal(True):
        log.warning("trainer.flush_denormal=true: torch cannot flush denormals on this CPU; the run goes on without")
        yield
        return
    try:
        if kept := _intra_op_share(flushing=False):
            log.warning(
                "trainer.flush_denormal=true: torch's intra-op threads started before it (by a large torch operation "
                "earlier in this process) keep computing on denormals, %.0f%% of a parallel operation's work; "
                "python -m expkit.train and expkit.lr_find set it before building anything, a script can call "
                "torch.set_flush_denormal(True) first, and a sweep's jobs that share a process keep it apart only "
                "in a process each (e.g. hydra/launcher=submitit_local)",
                100 * kept,
            )
        yield
    finally:
        torch.set_flush_denormal(False)
        if _intra_op_share(flushing=True):
            _left_flushing.add("threads")
            log.info(
                "trainer.flush_denormal=true: torch's intra-op threads started while it was on go on flushing "
                "denormals in this process"
            )


_TINY = sys.float_info.min / 2  # a denormal double
_GRAIN = 32768  # elements a parallel op gives each intra-op thread at least (torch's at::internal::GRAIN_SIZE)


def _intra_op_share(flushing: bool) -> float:
    """The share of a parallel operation's elements that torch's threads flush (`flushing`) or
    keep: a denormal for each thread's share at least, times one. 0.0 with one thread (nothing is
    asked); the calling thread's own share counts, so ask after setting it the other way."""
    threads = torch.get_num_threads()
    if threads < 2:
        return 0.0
    # fp32's largest denormal by its bits (a float fill would be flushed in a flushing thread already)
    denormals = torch.full((threads * _GRAIN,), 0x007FFFFF, dtype=torch.int32).view(torch.float32)
    kept = int((denormals * 1.0).count_nonzero()) / denormals.numel()
    return 1.0 - kept if flushing else kept


def flushing_denormals() -> bool:
    """Whether this thread's CPU flushes denormals to zero (torch has no getter).

    Returns:
        True when a denormal times one reads as zero here (MXCSR's DAZ or FTZ bit, which
            ``torch.set_flush_denormal`` sets).
    """
    one = 1.0
    return _TINY * one == 0.0


def rng_states() -> dict[str, Any]:
    """Python, NumPy and torch generator states as ASCII text and plain values, CUDA's as
    tensors (loadable with weights_only=True). The generators' words go as base64 text (``_text``):
    not as tensors, each of which is a record of its own in the checkpoint's zip file (about 40 us
    to write; 625 Python ints to a tensor take 45 us more), and not as bytes, which torch.save's
    pickle protocol (2) writes as latin-1 strings re-encoded to UTF-8 byte by byte. torch.save of
    the three states beside 680 KB of weights, warm: 266 us as bytes, 214 us as text, 208 us
    without them; the encoding takes 3-4 us (rng_states 17.5 -> 21 us), and the checkpoint is
    3 KB smaller (Python's words as 4-byte ints).

    Returns:
        The states by generator: ``python``, ``numpy``, ``torch`` and, once CUDA is initialised,
        ``cuda`` (a list of tensors, one per device).
    """
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": {"version": version, "internal": _text(array.array(_PY_WORDS, internal).tobytes()), "gauss": gauss},
        "numpy": _numpy_state(),
        "torch": _text(torch.get_rng_state().numpy().tobytes()),
    }
    if torch.cuda.is_initialized():  # (is_available() asks the driver: 10 us a call)
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


# Python's generator: 624 32-bit words and an index (at most 624), kept as unsigned 32-bit ints where
# "I" is 4 bytes (every platform torch builds for); checkpoints of 2026-11 hold them as "Q" (8 bytes)
_PY_WORDS = "I" if array.array("I").itemsize == 4 else "Q"


def _text(data: bytes) -> str:
    """`data` as base64 text, which torch.save pickles as it is (see rng_states)."""
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _bytes(value: Any) -> Any:
    """A state's words as bytes: from base64 text (rng_states since 2026-11-30); bytes (earlier
    checkpoints of 2026-11) and tensors (before) as they are."""
    return binascii.a2b_base64(value) if isinstance(value, str) else value


# NumPy's global generator as rng_states last read it: [(the generator, its C state's bytes, the
# state saved for them)], or [None] when that read found a cached gaussian (see _numpy_state)
_numpy_read: list[tuple[Any, bytes, dict[str, Any]] | None] = [None]
_MT19937_BYTES = 624 * 4 + 4  # NumPy's mt19937_state: uint32_t key[624]; int pos
_mt19937_layout: list[bool | None] = [None]  # whether MT19937's C state reads as NumPy's getter says (checked once)


def _mt19937_bytes(np: Any) -> tuple[Any, bytes] | None:
    """NumPy's global MT19937 generator and its C state's bytes (key and position), read through
    the generator's documented ctypes interface (``state_address``) in about a microsecond; None
    when the global generator is no MT19937, NumPy is older than 1.25, or the bytes were found not
    to read as NumPy's own getter says (the struct is NumPy's, not its API: see _numpy_state)."""
    get = getattr(np.random, "get_bit_generator", None)  # (NumPy 1.25+)
    generator = get() if get is not None else None
    if type(generator).__name__ != "MT19937" or _mt19937_layout[0] is False:
        return None
    return generator, ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES)


def _numpy_state() -> dict[str, Any]:
    """NumPy's global (legacy) generator state, as checkpoints keep it. NumPy's getter copies the
    624 words one Python operation at a time: 28 us warm, 80 us in a run's checkpoint. Most runs
    never draw from ``np.random``, so the generator's C state (2.5 KB, read in a microsecond) is
    compared with the one read last: unchanged, the state is the one read then. Not after a read
    that found a cached gaussian (``has_gauss``): using it changes the state without moving the
    generator, so the next read is a full one. The first full read checks that the C state's bytes
    are the key and position NumPy's getter gives; if not, every read is a full one. Putting back a
    state with a cached gaussian and the same words is not seen here: ``set_rng_states`` forgets the
    last read (a user's own ``np.random.set_state`` of such a state between two saves would not be)."""
    import numpy as np

    current = _mt19937_bytes(np)
    last = _numpy_read[0]
    if current is not None and last is not None and last[0] is current[0] and last[1] == current[1]:
        return dict(last[2])
    _, keys, pos, has_gauss, cached = np.random.get_state()
    words = keys.astype(np.uint32).tobytes()
    state = {"keys": _text(words), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if current is not None and _mt19937_layout[0] is None:
        _mt19937_layout[0] = current[1] == words + state["pos"].to_bytes(4, sys.byteorder)
    known = current is not None and _mt19937_layout[0] and not has_gauss
    _numpy_read[0] = (current[0], current[1], state) if known else None  # type: ignore[index]
    return dict(state)


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Put back what ``rng_states`` saved (older checkpoints hold bytes or tensors: also read).

    Args:
        states: what ``rng_states`` returned (base64 text; the bytes or tensors of older checkpoints); ``numpy``
            and ``cuda`` are optional, and ``cuda`` is put back only when CUDA is available.
    """
    import numpy as np

    py = states["python"]
    internal = _bytes(py["internal"])
    if isinstance(internal, bytes):  # (625 words: "Q" by their size in checkpoints of 2026-11, else "I")
        internal = array.array("Q" if len(internal) == 625 * 8 else _PY_WORDS, internal).tolist()
    else:
        internal = internal.tolist()
    random.setstate((py["version"], tuple(internal), py["gauss"]))
    if "numpy" in states:
        n = states["numpy"]
        keys = _bytes(n["keys"])
        keys = np.frombuffer(keys, dtype=np.uint32) if isinstance(keys, bytes) else keys.numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached"]))
        # the generator's words may equal those last read while its cached gaussian differs
        _numpy_read[0] = None
    state = _bytes(states["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8) if isinstance(state, bytes) else state)
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
