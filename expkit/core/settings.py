"""The loop settings (config group ``trainer``), checked when built: errors name the key."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from expkit.core.errors import ConfigError

__all__ = ["TrainerSettings", "check_device"]

# the signals trainer.requeue_signal may name: INT and TERM already stop a run (and Slurm's scancel
# sends TERM: no requeue), KILL and STOP cannot be caught, CHLD, PIPE and the faults mean other things
# (by name: a platform without one, Windows, takes the setting and ignores the signal)
_REQUEUE_SIGNALS = ("USR1", "USR2", "HUP", "URG", "XCPU", "PWR")


def check_device(key: str, device: Any, torch_runs_it: bool = True) -> None:
    """A device setting (``trainer.device``, a command's ``device``): auto, cpu, cuda or cuda:N, and
    CUDA only where torch has it (when torch runs the model).

    Args:
        key: the config key, named in the error.
        device: its value.
        torch_runs_it: whether torch runs on it (not onnxruntime, which checks its own providers).

    Raises:
        ConfigError: naming `key` and what to type instead.
    """
    if not (
        device in ("auto", "cpu", "cuda")
        or (isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit())
    ):
        raise ConfigError(f"{key} must be auto, cpu, cuda or cuda:N, got {device!r}")
    if torch_runs_it and device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={device} but CUDA is not available here; use {key}=auto or cpu")


@dataclasses.dataclass
class TrainerSettings:
    """The loop settings (config group ``trainer``)."""

    max_epochs: int | None = 20
    max_iters: int | None = None  # iteration-based training when set
    val_interval: int = 1  # epochs, or iterations when max_iters is set
    val_begin: int = 1  # first epoch (or iteration) that validates
    seed: int | None = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "32"  # 32 | bf16 | 16
    clip_grad_norm: float | None = None  # max gradient norm; None = no clipping
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step; iterations count optimizer steps
    test_with: str = "best"  # best: test the best checkpoint (by the first save_best metric); last: the final weights
    deterministic: bool = False  # torch's deterministic algorithms (slower; bit-reproducible runs)
    compile: bool = False  # torch.compile the model's forward (in place: state_dict keys unchanged)
    channels_last: bool = False  # model and 4-D inputs in channels-last memory format (faster convolutions)
    cudnn_benchmark: bool = True  # on CUDA, let cuDNN pick the fastest kernels (off when deterministic)
    flush_denormal: bool = False  # on the CPU, denormal floats read and written as zero (faster; last bits differ)
    strategy: str = "ddp"  # under torchrun: ddp (every rank holds the whole model) | fsdp (FSDP2, sharded)
    fsdp_blocks: list[str] | None = None  # fsdp: module class names sharded one by one; None: the model's default
    fsdp_param_dtype: str | None = None  # fsdp: dtype the gathered parameters compute in (bf16 | 32); None: their own
    fsdp_reduce_dtype: str | None = None  # fsdp: dtype gradients are reduced in (32 | bf16); None: the compute dtype
    fsdp_offload: bool = False  # fsdp on CUDA: sharded parameters, gradients and optimizer state in CPU memory
    activation_checkpointing: str | list[str] | None = None  # None: off | full: every block | [ClassName, ...]
    requeue_signal: str | None = "USR1"  # save, stop and requeue the Slurm job on this signal; None: off
    save_before_limit: bool = True  # under Slurm: save, stop and requeue before the job's time limit cuts a save
    limit_margin_s: float = 60  # save_before_limit: seconds kept before the limit on top of an iteration and a save

    def __post_init__(self) -> None:
        def positive(key: str, value: Any, allow_none: bool) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"trainer.{key} must be a positive integer, got {value!r}; e.g. trainer.{key}=10")

        positive("max_epochs", self.max_epochs, allow_none=True)
        positive("max_iters", self.max_iters, allow_none=True)
        positive("val_interval", self.val_interval, allow_none=False)
        positive("val_begin", self.val_begin, allow_none=False)
        positive("accumulate_grad_batches", self.accumulate_grad_batches, allow_none=False)
        if self.max_epochs is None and self.max_iters is None:
            raise ConfigError("set trainer.max_epochs=N (epoch-based) or trainer.max_iters=N (iteration-based)")
        self.precision = str(self.precision)
        if self.precision not in ("32", "bf16", "16"):
            raise ConfigError(f"trainer.precision must be 32, bf16 or 16, got {self.precision!r}")
        check_device("trainer.device", self.device)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"trainer.seed must be an integer or null, got {self.seed!r}")
        if self.clip_grad_norm is not None and not (
            isinstance(self.clip_grad_norm, (int, float)) and 0 < self.clip_grad_norm < float("inf")
        ):
            raise ConfigError(f"trainer.clip_grad_norm must be a positive number or null, got {self.clip_grad_norm!r}")

        for key in ("deterministic", "compile", "channels_last", "cudnn_benchmark", "flush_denormal"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"trainer.{key} must be true or false, got {getattr(self, key)!r}")
        if self.strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"trainer.strategy must be ddp or fsdp, got {self.strategy!r}")
        if self.fsdp_blocks is not None:
            blocks = [self.fsdp_blocks] if isinstance(self.fsdp_blocks, str) else self.fsdp_blocks
            if not isinstance(blocks, (list, tuple)) or not blocks or not all(isinstance(b, str) for b in blocks):
                raise ConfigError(
                    "trainer.fsdp_blocks must be a list of module class names, e.g. "
                    f"trainer.fsdp_blocks=[TransformerEncoderLayer], got {self.fsdp_blocks!r}"
                )
            self.fsdp_blocks = list(blocks)
        if self.strategy == "fsdp" and self.precision == "16":
            raise ConfigError(
                "trainer.precision=16 with trainer.strategy=fsdp: fp16's gradient scaler does not "
                "work on sharded gradients here; use trainer.precision=bf16"
            )
        if self.test_with not in ("best", "last"):
            raise ConfigError(f"trainer.test_with must be best or last, got {self.test_with!r}")
        self._check_requeue_settings()
        self._check_memory_settings()

    def _check_memory_settings(self) -> None:
        """activation_checkpointing is null, full or class names (stored as a list); the FSDP2
        settings apply to trainer.strategy=fsdp only. (Offloading needs CUDA: checked where a run
        is built to train, so that a checkpoint of such a run still evaluates on a CPU.)"""
        setting = self.activation_checkpointing
        names = [setting] if isinstance(setting, str) and setting != "full" else setting
        if setting != "full" and names is not None:
            if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(
                    "trainer.activation_checkpointing must be null (off), full (every block) or a list of "
                    f"module class names, e.g. trainer.activation_checkpointing=[GPT2Block]; got {setting!r}"
                )
            self.activation_checkpointing = list(names)
        for key, valid in (("fsdp_param_dtype", ("bf16", "32")), ("fsdp_reduce_dtype", ("32", "bf16"))):
            value = getattr(self, key)
            if value is None:
                continue
            if str(value) not in valid:
                raise ConfigError(f"trainer.{key} must be {' or '.join(valid)} or null, got {value!r}")
            setattr(self, key, str(value))
        if not isinstance(self.fsdp_offload, bool):
            raise ConfigError(f"trainer.fsdp_offload must be true or false, got {self.fsdp_offload!r}")
        for key in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_offload"):
            if getattr(self, key) not in (None, False) and self.strategy != "fsdp":
                raise ConfigError(
                    f"trainer.{key} sets FSDP2's sharding: add trainer.strategy=fsdp, or leave trainer.{key} unset"
                )

    def _check_requeue_settings(self) -> None:
        """requeue_signal names a signal a run may take (not one that already stops it or that
        cannot be caught); stored as its bare name (``USR1``)."""
        if self.requeue_signal is not None:
            name = str(self.requeue_signal).upper().removeprefix("SIG")
            if name not in _REQUEUE_SIGNALS:
                raise ConfigError(
                    f"trainer.requeue_signal must be a signal name such as USR1 or USR2, or null; got "
                    f"{self.requeue_signal!r} (valid: {', '.join(_REQUEUE_SIGNALS)})"
                )
            self.requeue_signal = name
        if not isinstance(self.save_before_limit, bool):
            raise ConfigError(f"trainer.save_before_limit must be true or false, got {self.save_before_limit!r}")
        margin = self.limit_margin_s
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < float("inf"):
            raise ConfigError(f"trainer.limit_margin_s must be a number of seconds >= 0, e.g. 60; got {margin!r}")

    def steps_per_epoch(self, batches: int) -> int:
        """Optimizer steps in an epoch of `batches` batches (the last window may be shorter)."""
        return -(-batches // self.accumulate_grad_batches)

    @property
    def by_epoch(self) -> bool:
        return self.max_iters is None
