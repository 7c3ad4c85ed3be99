"""LogPredictionsHook: a fixed set of validation samples with the model's predictions, on the
dashboards, every ``interval`` validations (LOW, after the validation's own records).

For image classifiers: one image, a grid of the samples with ``p<predicted> t<true>`` under
each (green when right, red when wrong); otherwise a table (sample, target, prediction). It
goes to every backend of ``logger=[...]`` (TensorBoard ``add_image`` / ``add_text``, wandb
``Image`` / ``Table``, MLflow ``log_image`` / ``log_table``) under ``val/predictions`` at the
validation's step, and, with ``save=true``, to ``<work dir>/predictions/step_<n>.png`` (or
``.md``). MMEngine's Visualizer and Lightning's ``log_image`` do this; here it needs no code.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.stages import Priority
from expkit.hooks.base import Hook
from expkit.loggers.backends import markdown_table

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["LogPredictionsHook"]


log = logging.getLogger("expkit")


class LogPredictionsHook(Hook):
    """``num_samples``: how many validation samples (the first ones of the validation set, the
    same at every validation); ``interval``: every n validations; ``tile``: the side in pixels
    of each image in the grid; ``save``: also write the image (or table) into the work dir.

    Args:
        num_samples: the number of samples shown: the first ones of the (first) validation loader, read
            once and reused (this process's share under DDP).
        interval: show them at every ``interval``-th validation of training (the count survives a resume).
        tile: the side, in pixels, of each image in the grid (image classifiers only).
        save: also write ``<work dir>/predictions/step_<n>.png`` (or ``.md`` for a table).

    Raises:
        ValueError: `num_samples`, `interval` or `tile` is not a positive integer.
    """

    priority = Priority.LOW

    def __init__(self, num_samples: int = 16, interval: int = 1, tile: int = 64, save: bool = True) -> None:
        for key, value in (("num_samples", num_samples), ("interval", interval), ("tile", tile)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        self.num_samples, self.interval, self.tile, self.save = num_samples, interval, tile, save
        self.validations = 0
        self._batch: Any = None
        self._warned: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validations = int(state.get("validations", 0))

    def _samples(self, runner: Runner) -> Any:
        """The first `num_samples` samples of the validation set (this rank's share under DDP)."""
        if self._batch is None:
            loader = runner.val_loader
            if isinstance(loader, dict):
                loader = next(iter(loader.values()))
            inputs, targets = [], []
            for batch in loader:  # type: ignore[union-attr]
                if not isinstance(batch, (list, tuple)) or len(batch) < 2:
                    return None
                inputs.append(batch[0])
                targets.append(batch[1])
                if sum(len(t) for t in targets) >= self.num_samples:
                    break
            self._batch = (torch.cat(inputs)[: self.num_samples], torch.cat(targets)[: self.num_samples])
        return self._batch

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        if runner.optimizer is None:  # evaluation only (expkit.eval): no step axis to log at
            return
        self.validations += 1
        if self.validations % self.interval or runner.val_loader is None:
            return
        batch = self._samples(runner)
        if batch is None:
            if "batch" not in self._warned:
                self._warned.add("batch")
                log.warning("LogPredictionsHook: validation batches are not (inputs, targets); nothing logged")
            return
        was_training = runner.model.training
        runner.model.eval()
        try:  # every rank: under FSDP a forward gathers parameters from all of them
            with torch.no_grad(), runner.autocast():
                outputs = runner.eval_step(runner.to_device(batch))
        finally:
            runner.model.train(was_training)
        if not runner.is_main:
            return
        inputs, targets = batch
        try:  # (rank 0 alone from here: a failure must not end the run, nor leave the other ranks waiting)
            predictions = _predictions(outputs)
            if (
                inputs.dim() == 4
                and inputs.shape[1] in (1, 3)
                and predictions.dim() == 1
                and not predictions.is_floating_point()
            ):
                self._send(runner, "image", _grid(inputs, predictions, targets, self.tile))
            else:
                self._send(runner, "table", _table(predictions, targets))
        except Exception as exc:
            if "predictions" not in self._warned:
                self._warned.add("predictions")
                log.warning(
                    "LogPredictionsHook: cannot show this model's predictions (%s: %s); nothing logged",
                    type(exc).__name__,
                    exc,
                )

    def _send(self, runner: Runner, kind: str, content: Any) -> None:
        tag, step = "val/predictions", runner.iter
        if self.save:
            folder = runner.work_dir / "predictions"
            folder.mkdir(exist_ok=True)
            if kind == "image":
                from PIL import Image

                Image.fromarray(content).save(folder / f"step_{step}.png")
            else:
                (folder / f"step_{step}.md").write_text(markdown_table(content), encoding="utf-8")
        for name, backend in runner.loggers.items():
            if name in self._warned:  # failed before: not tried again
                continue
            try:
                getattr(backend, f"log_{kind}")(tag, content, step)
            except Exception as exc:
                self._warned.add(name)
                log.warning(
                    "LogPredictionsHook: %s could not take the %s (%s: %s); not tried again",
                    name,
                    kind,
                    type(exc).__name__,
                    exc,
                )


def _predictions(outputs: dict[str, Any]) -> torch.Tensor:
    if outputs.get("preds") is not None:
        return outputs["preds"].detach().cpu()
    logits = outputs["logits"].detach().float().cpu()
    if logits.dim() == 2 and logits.shape[1] > 1:
        return logits.argmax(dim=1)
    return logits.reshape(len(logits), -1).squeeze(1) if logits.dim() == 2 else logits


def _grid(inputs: torch.Tensor, predictions: torch.Tensor, targets: torch.Tensor, tile: int) -> Any:
    """An RGB uint8 array (H, W, 3): the images, enlarged to `tile` pixels, 8 per row, with
    ``p<pred> t<true>`` under each."""
    import numpy as np
    from PIL import Image, ImageDraw

    images = inputs.detach().float().cpu()
    low, high = images.amin(dim=(1, 2, 3), keepdim=True), images.amax(dim=(1, 2, 3), keepdim=True)
    images = ((images - low) / (high - low).clamp_min(1e-8) * 255).to(torch.uint8)
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    columns = min(8, len(images))
    rows = -(-len(images) // columns)
    label_h = 14
    canvas = Image.new("RGB", (columns * tile, rows * (tile + label_h)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (image, pred, true) in enumerate(zip(images, predictions.tolist(), targets.tolist())):
        x, y = (i % columns) * tile, (i // columns) * (tile + label_h)
        picture = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((tile, tile), Image.NEAREST)
        canvas.paste(picture, (x, y))
        draw.text((x + 2, y + tile + 1), f"p{pred} t{true}", fill=(0, 128, 0) if pred == true else (200, 0, 0))
    return np.asarray(canvas)


def _table(predictions: torch.Tensor, targets: torch.Tensor) -> list[list[Any]]:
    def value(t: torch.Tensor) -> Any:
        if t.numel() == 1:
            return round(float(t), 6) if t.is_floating_point() else int(t)
        return f"tensor{tuple(t.shape)}"

    return [[i, value(t), value(p)] for i, (t, p) in enumerate(zip(targets, predictions))]
