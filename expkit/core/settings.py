"""The loop settings (config group ``trainer``), checked when built: errors name the key."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from expkit.core.errors import ConfigError

__all__ = ["TrainerSettings"]


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
    strategy: str = "ddp"  # under torchrun: ddp (every rank holds the whole model) | fsdp (FSDP2, sharded)
    fsdp_blocks: list[str] | None = None  # fsdp: module class names sharded one by one; None: the model's default

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
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            raise ConfigError(f"trainer.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.device={self.device} but CUDA is not available here; use trainer.device=auto or cpu"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"trainer.seed must be an integer or null, got {self.seed!r}")
        if self.clip_grad_norm is not None and not (
            isinstance(self.clip_grad_norm, (int, float)) and 0 < self.clip_grad_norm < float("inf")
        ):
            raise ConfigError(f"trainer.clip_grad_norm must be a positive number or null, got {self.clip_grad_norm!r}")

        for key in ("deterministic", "compile", "channels_last", "cudnn_benchmark"):
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

    def steps_per_epoch(self, batches: int) -> int:
        """Optimizer steps in an epoch of `batches` batches (the last window may be shorter)."""
        return -(-batches // self.accumulate_grad_batches)

    @property
    def by_epoch(self) -> bool:
        return self.max_iters is None
