"""Forward hooks on named modules for one forward pass: what the measuring hooks share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from expkit.core.activation_checkpointing import parameter_name

__all__ = ["OutputProbe", "leaf_modules"]


def leaf_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules without children, by name (the root itself when it has none).

    Args:
        model: the model.

    Returns:
        The leaf modules by qualified name; a root without children is named after its class.
    """
    return {parameter_name(name) or type(m).__name__: m for name, m in model.named_modules() if not list(m.children())}


class OutputProbe:
    """Calls ``record(name, output)`` for each named module's tensor output until ``remove()``.
    Attach it right before the forward pass you want to observe, remove it right after.

    Args:
        modules: the modules to observe, by name; a forward hook is registered on each at once.
            The name is what `record` receives.
        record: called with (name, output) after each forward pass of a module whose output is a
            tensor; other outputs (tuples, dicts, ...) are skipped.
    """

    def __init__(self, modules: Mapping[str, nn.Module], record: Callable[[str, torch.Tensor], None]) -> None:
        def hook(name: str) -> Callable[..., None]:
            def on_output(module: nn.Module, inputs: Any, output: Any) -> None:
                if isinstance(output, torch.Tensor):
                    record(name, output)

            return on_output

        self._handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
