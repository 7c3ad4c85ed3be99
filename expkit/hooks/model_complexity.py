"""ModelComplexityHook: FLOPs, parameters and activations of one forward pass (VERY_HIGH)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from expkit.core.stages import Priority
from expkit.hooks._probes import OutputProbe, leaf_modules
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["ModelComplexityHook", "model_complexity"]


log = logging.getLogger("expkit")


def model_complexity(model: nn.Module, example: torch.Tensor) -> dict[str, int]:
    """FLOPs (torch's FlopCounterMode: a multiply-add counts 2), parameters, and activations
    (elements output by the leaf modules) of one forward pass on `example`, in eval mode.

    Args:
        model: the model; put back in its training mode afterwards.
        example: the input of the forward pass, batch dimension included, on the model's device.

    Returns:
        ``flops``, ``params``, ``trainable_params`` and ``activations`` of that pass (for the whole
        batch of `example`).
    """
    from torch.utils.flop_counter import FlopCounterMode

    sizes: list[int] = []
    probe = OutputProbe(leaf_modules(model), lambda name, output: sizes.append(output.numel()))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(example)
    finally:
        model.train(was_training)
        probe.remove()
    activations = sum(sizes)
    return {
        "flops": int(counter.get_total_flops()),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "activations": activations,
    }


class ModelComplexityHook(Hook):
    """Before the run, one forward pass on a synthetic input of ``input_shape`` (one sample,
    no batch dimension; None: the shape of the first training sample). Logged, and kept
    in result.json under ``model_complexity`` (per sample).

    Args:
        input_shape: the shape of one sample without the batch dimension, e.g. ``[3, 32, 32]``; the
            forward pass gets a batch of one float tensor of zeros of that shape. None: the shape of
            the first sample of the training set (else of the validation or test set).
    """

    priority = Priority.VERY_HIGH

    def __init__(self, input_shape: Sequence[int] | None = None) -> None:
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.result: dict[str, int] = {}

    def before_run(self, runner: Runner) -> None:
        shape = self.input_shape
        if shape is None:
            loader = runner.train_loader or runner.val_loader or runner.test_loader
            sample = loader.dataset[0]  # type: ignore[union-attr]
            shape = tuple((sample[0] if isinstance(sample, (tuple, list)) else sample).shape)
        example = torch.zeros((1, *shape), device=runner.device)
        self.result = model_complexity(runner.model, example)
        runner.run_info["model_complexity"] = {"input_shape": list(shape), **self.result}
        r = self.result
        log.info(
            "Model complexity for input %s: %s FLOPs, %s parameters (%s trainable), %s activations",
            "x".join(map(str, shape)),
            f"{r['flops']:,}",
            f"{r['params']:,}",
            f"{r['trainable_params']:,}",
            f"{r['activations']:,}",
        )
