"""An exported model's data module: the preprocessing and class names that the sidecar JSON
``expkit.export`` wrote beside a ``model.onnx`` records (another runtime has no data module to call),
for ``expkit.predict checkpoint=<model.onnx>``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from expkit.core.errors import ConfigError
from expkit.data import DataModule, preprocess

if TYPE_CHECKING:
    import torch

__all__ = ["ExportedData"]


class ExportedData(DataModule):
    """An exported model's data, as the sidecar JSON ``expkit.export`` wrote beside it records it
    (another runtime has no data module to call): ``predict_input`` applies the recorded
    ``preprocessing`` and reshapes to the recorded ``input_shape``, ``predict_image`` the image
    transform of the recorded ``in_channels`` and ``image_size``, ``predict_output`` the recorded
    ``postprocessing``; ``class_names`` are the recorded ones.

    Args:
        info: the sidecar JSON's contents.
        sidecar: its path, named in messages.
    """

    def __init__(self, info: dict[str, Any], sidecar: Path) -> None:
        super().__init__()
        self.info, self.sidecar = info, sidecar
        self.shape = tuple(info["input_shape"][1:])
        description = info.get("data_description") or {}
        # predict_image (DataModule's) makes images grey or RGB and resizes them by these two
        for key in ("in_channels", "image_size"):
            if key in description:
                setattr(self, key, description[key])

    def predict_input(self, raw: torch.Tensor) -> torch.Tensor:
        """The preprocessing the export's sidecar JSON records, then its input shape.

        Args:
            raw: the inputs, first dimension the batch, as read from the file.

        Returns:
            The inputs as the exported model takes them.

        Raises:
            ConfigError: when the sidecar records no preprocessing.
        """
        steps = self.info.get("preprocessing")
        if steps is None:
            raise ConfigError(
                f"checkpoint={self.sidecar.with_suffix('')}: {self.sidecar.name} records no preprocessing (exported "
                "before expkit recorded it, or its data module transforms inputs its own way): export it again, "
                "give inputs as the model takes them with preprocessed=true, or predict from the run's checkpoint"
            )
        return preprocess(raw, steps, self.shape)

    def named(self) -> str:
        """The recorded preprocessing in words, for the log and messages.

        Returns:
            E.g. ``model.onnx.json's preprocessing (mean 0, std 16: (raw - mean) / std)``.
        """
        steps = self.info.get("preprocessing") or {}

        def number(value: Any) -> str:
            return f"{value:g}" if isinstance(value, (int, float)) else f"one per feature ({len(value)})"

        said = f"mean {number(steps.get('mean', 0))}, std {number(steps.get('std', 1))}"
        if steps.get("only_dtype"):
            said += f", {steps['only_dtype']} inputs only"
        return f"{self.sidecar.name}'s preprocessing ({said}: {steps.get('formula', '(raw - mean) / std')})"

    def class_names(self) -> list[str] | None:
        """The class names the sidecar records.

        Returns:
            The names, in class-index order; None when it records none.
        """
        return self.info.get("class_names")

    def postprocessing(self) -> dict[str, Any] | None:
        """The output scaling the sidecar records (``predict_output`` applies it).

        Returns:
            ``mean``, ``std`` and ``formula``; None when it records none (outputs as they are).
        """
        return self.info.get("postprocessing")
