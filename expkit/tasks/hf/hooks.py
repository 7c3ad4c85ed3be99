"""The Hugging Face hooks: ``SavePretrained`` (the trained model in transformers' own form, with
its tokenizer) and ``SampleText`` (text generated after each validation)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from expkit.core.errors import ConfigError
from expkit.core.stages import Priority
from expkit.hooks.base import Hook
from expkit.tasks.hf.models import HFModel
from expkit.tasks.hf.tokenizer import SPECIAL

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["SampleText", "SavePretrained", "fast_tokenizer", "write_pretrained"]


log = logging.getLogger("expkit")


def fast_tokenizer(model: HFModel) -> Any:
    """The tokenizer the model was trained with, as transformers' PreTrainedTokenizerFast; None without one.

    Args:
        model: the wrapped model (its ``tokenizer_json`` is read).

    Returns:
        The tokenizer, with ``<|endoftext|>`` as its end-of-text and ``<|pad|>`` as its padding
            token; None when the model has no ``tokenizer_json``.
    """
    from transformers import PreTrainedTokenizerFast

    if not model.tokenizer_json:
        return None
    from tokenizers import Tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(model.tokenizer_json), eos_token=SPECIAL[0], pad_token=SPECIAL[1]
    )


def _unwrapped(runner: Runner) -> HFModel:
    model = runner.model
    if not isinstance(model, HFModel):
        raise ConfigError(
            f"this hook needs a Hugging Face model (expkit.tasks.hf.HFModel, e.g. model=hf_causal_lm), "
            f"not {type(model).__name__}"
        )
    return model


class SavePretrained(Hook):
    """At the end of the run: the trained model in transformers' own form, ``<work dir>/<dir>``
    (``config.json``, ``model.safetensors``, and the tokenizer when the data trained one),
    which plain transformers loads with ``from_pretrained``. With FSDP2 the full weights are
    gathered first (every rank takes part; rank 0 writes).

    Nothing is written when the run trained nothing or failed.

    Args:
        dir: the directory, relative to the work dir.
    """

    priority = Priority.LOW

    def __init__(self, dir: str = "hf_model") -> None:
        self.dir = dir

    def before_run(self, runner: Runner) -> None:
        _unwrapped(runner)  # (another model: refused before training, not after it)

    def after_run(self, runner: Runner) -> None:
        if runner.optimizer is None or runner.error is not None or not isinstance(runner.model, HFModel):
            return  # (nothing trained, or the run failed: before_run said why)
        model = runner.model
        state = None
        if runner.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not runner.is_main:
            return
        write_pretrained(model, runner.work_dir / self.dir, state)


def write_pretrained(model: HFModel, target: Path, state: dict[str, Any] | None = None) -> None:
    """`model` in transformers' own form in the directory `target` (``config.json``,
    ``model.safetensors``, the tokenizer when the data trained one), for ``from_pretrained``.
    `state`: the full weights when the model's own are sharded (FSDP2).

    Args:
        model: the wrapped model.
        target: the directory to write.
        state: the full state dict to save; None saves the model's own weights.
    """
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (its "Writing model shards" bar, in a run's log)
    try:
        model.model.save_pretrained(str(target), state_dict=state)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer = fast_tokenizer(model)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(target))
    log.info("Saved the model for transformers' from_pretrained: %s", target)


class SampleText(Hook):
    """After each validation (rank 0): ``num_samples`` texts of ``max_new_tokens`` tokens
    generated from ``prompt`` by ``model.generate`` (sampling at ``temperature``, from the
    run's seed), appended to ``<work dir>/samples.txt`` and shown in the log.

    Args:
        prompt: the text the samples start with.
        max_new_tokens: the tokens generated for each sample.
        num_samples: the number of samples after each validation.
        temperature: the sampling temperature.
    """

    priority = Priority.LOW

    def __init__(
        self, prompt: str = "The ", max_new_tokens: int = 40, num_samples: int = 2, temperature: float = 0.8
    ) -> None:
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.num_samples, self.temperature = num_samples, temperature

    def before_run(self, runner: Runner) -> None:
        _unwrapped(runner)

    def after_val_epoch(self, runner: Runner, *, metrics: dict[str, float]) -> None:
        model = _unwrapped(runner)
        tokenizer = fast_tokenizer(model)
        if tokenizer is None or not (runner.is_main or runner.sharded):
            return
        from expkit.core.rng import rng_states, set_rng_states

        states, was_training = rng_states(), model.training
        try:
            torch.manual_seed(runner.settings.seed or 0)  # (the same on every rank: the same samples)
            model.eval()
            if runner.sharded:  # generate() calls the inner model, not this root: its own parameters gathered here
                model.unshard()  # type: ignore[operator]
            ids = tokenizer(self.prompt, return_tensors="pt")["input_ids"].to(runner.device)
            # synced_gpus: under FSDP2 every rank runs as many forward passes (each gathers weights)
            out = model.generate(
                ids,
                do_sample=True,
                temperature=self.temperature,
                max_new_tokens=self.max_new_tokens,
                num_return_sequences=self.num_samples,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=runner.sharded,
            )
        finally:
            if runner.sharded:
                model.reshard()  # type: ignore[operator]
            model.train(was_training)
            set_rng_states(states)
        if not runner.is_main:
            return
        texts = tokenizer.batch_decode(out, skip_special_tokens=True)
        with open(runner.work_dir / "samples.txt", "a", encoding="utf-8") as f:
            f.writelines(f"--- epoch {runner.epoch} iteration {runner.iter}\n{text}\n" for text in texts)
        log.info("Sample: %s", texts[0].replace("\n", " ")[:200])
