"""Hugging Face models as expkit models: ``HFModel`` wraps any ``transformers`` PreTrainedModel
(dict batches as keyword arguments, the model's own loss, logits for the metrics);
``causal_lm`` and ``sequence_classifier`` build one from a config or a local
``save_pretrained`` directory (never a download), sized to the data."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from expkit.core.errors import ConfigError
from expkit.tasks.hf.tokenizer import _needs

__all__ = ["HFModel", "causal_lm", "is_transformers_model", "sequence_classifier"]


def is_transformers_model(model: Any) -> bool:
    """A ``transformers`` PreTrainedModel (told without importing transformers).

    Args:
        model: any object.

    Returns:
        True when ``transformers.modeling_utils.PreTrainedModel`` is among its type's bases.
    """
    return any(
        c.__module__ == "transformers.modeling_utils" and c.__name__ == "PreTrainedModel" for c in type(model).__mro__
    )


class HFModel(nn.Module):
    """A ``transformers`` PreTrainedModel as an expkit model. A batch is a dict passed as
    keyword arguments; the loss is the model's own (it computes one when ``labels`` are
    given); ``logits`` and ``targets`` go to the metrics, for a causal LM shifted so that
    position t predicts token t + 1 (``torchmetrics.text.Perplexity`` reads them).

    Args:
        model: the ``transformers`` model.
        tokenizer_json: the tokenizer the model is trained with, as ``tokenizer.json`` text (for
            ``expkit.predict``, ``SampleText`` and ``save_pretrained``); None: none.
    """

    def __init__(self, model: nn.Module, tokenizer_json: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.tokenizer_json = tokenizer_json
        self.causal = type(model).__name__.endswith("ForCausalLM") or "LMHead" in type(model).__name__
        self.fsdp_blocks = tuple(getattr(model, "_no_split_modules", None) or ())
        # a training step reads no KV cache: none is built (activation checkpointing would fill one
        # twice, recomputing each block in backward)
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
        self._train_options: dict[str, Any] = {"use_cache": False} if takes_cache else {}

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def counted_tokens(self, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The number of tokens a causal LM's loss is the mean over: the labels after the first
        position that are not -100 (transformers' ignored label: padding). Gradient accumulation
        weighs micro-batches by it, so they add up to the gradient of one batch of all of them.

        Args:
            batch: the model's keyword arguments, ``labels`` included.

        Returns:
            The count, a tensor on the labels' device; None when the model is not a causal LM or
            the batch has no labels (the loss is then a mean over samples).
        """
        labels = batch.get("labels") if self.causal and isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
            return None
        return (labels[..., 1:] != -100).sum()

    def _outputs(self, batch: Mapping[str, Any], **options: Any) -> tuple[Any, Any]:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"a Hugging Face model takes dict batches (input_ids, labels, ...), got {type(batch).__name__}"
            )
        out = self.model(**batch, **options)
        if getattr(out, "loss", None) is None:
            raise ValueError("the model computed no loss: the batch needs labels (a `labels` entry)")
        return out, batch.get("labels")

    def train_step(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The model's own loss on the batch.

        Args:
            batch: the model's keyword arguments, ``labels`` included.

        Returns:
            The ``loss`` and the ``logits``.

        Raises:
            TypeError: when the batch is not a mapping.
            ValueError: when the model computes no loss (the batch has no ``labels``).
        """
        out, _ = self._outputs(batch, **self._train_options)
        return {"loss": out.loss, "logits": out.logits}

    def eval_step(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The model's own loss, and the logits and labels for the metrics.

        Args:
            batch: the model's keyword arguments, ``labels`` included.

        Returns:
            The ``loss``, the ``logits`` and the labels as ``targets``; for a causal LM, shifted so
                that position t predicts token t + 1.

        Raises:
            TypeError: when the batch is not a mapping.
            ValueError: when the model computes no loss (the batch has no ``labels``).
        """
        out, labels = self._outputs(batch)
        logits = out.logits
        if self.causal and labels is not None:  # position t predicts token t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        return {"loss": out.loss, "logits": logits, "targets": labels}

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate``, without gradients.

        Args:
            *args: its positional arguments (the input ids).
            **kwargs: its keyword arguments (``max_new_tokens``, ``do_sample``, ...).

        Returns:
            What the wrapped model's ``generate`` returns (the generated token ids).
        """
        return self.model.generate(*args, **kwargs)


def _auto_config(kind: str, **settings: Any) -> Any:
    """``AutoConfig.for_model(kind, **settings)``; a model type transformers does not know is a
    ConfigError with the close matches."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), n=5, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ConfigError(f"model.config.model_type={kind!r} is not a transformers model type{hint}")
    try:
        return AutoConfig.for_model(kind, **settings)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"model.config: {exc}") from None


def _check_pretrained(model: Any, pretrained: str, vocab_size: int, length_key: str, length: int | None) -> None:
    """A model read from `pretrained` must hold the data's token ids and sequence length:
    otherwise its embedding lookup fails deep in the first step (an IndexError)."""
    config = model.config
    rows = model.get_input_embeddings().num_embeddings
    if vocab_size > rows:
        own = Path(pretrained).expanduser() / "tokenizer.json"
        hint = (
            f"give the model's own tokenizer, data.tokenizer={own}"
            if own.is_file()
            else f"give data.tokenizer=<the tokenizer.json the model was trained with>, or data.vocab_size={rows}"
        )
        raise ConfigError(
            f"model.pretrained={pretrained}: the model embeds {rows} token ids but the data's tokenizer "
            f"has {vocab_size}; {hint}"
        )
    _check_positions(config, f"model.pretrained={pretrained}: the model", length_key, length)


def _check_positions(config: Any, who: str, length_key: str, length: int | None) -> None:
    """A model config (`who` in the message) must allow the data's sequence length."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if length is not None and isinstance(positions, int) and positions < length:
        raise ConfigError(f"{who} allows {positions} positions, fewer than {length_key}={length}")


def _local_dir(pretrained: str) -> str:
    """`pretrained` as a local save_pretrained directory; never a hub name (nothing is downloaded)."""
    path = Path(pretrained).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.pretrained={pretrained}: not a local model directory (no config.json in it); "
            "expkit does not download: give a directory written by save_pretrained"
        )
    return str(path)


def causal_lm(
    vocab_size: int,
    config: Mapping[str, Any] | None = None,
    pretrained: str | None = None,
    tokenizer_json: str | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    block_size: int | None = None,
) -> HFModel:
    """A causal language model: ``AutoModelForCausalLM.from_config`` of ``config`` (a dict
    with ``model_type``, e.g. ``gpt2``, and that model type's settings), sized to the data's
    vocabulary; or ``from_pretrained`` of a local directory (``pretrained``: never downloaded).

    Args:
        vocab_size: the data's vocabulary size.
        config: ``model_type`` and that model type's settings; not used with `pretrained`.
        pretrained: a local ``save_pretrained`` directory to load instead.
        tokenizer_json: the data's tokenizer, kept with the model.
        eos_token_id: the end-of-text token, set as the config's ``bos_token_id`` and
            ``eos_token_id`` unless `config` sets them.
        pad_token_id: the padding token, set as the config's ``pad_token_id`` unless `config` sets it.
        block_size: the data's sequence length, checked against the model's positions.

    Returns:
        The model, wrapped in ``HFModel``.

    Raises:
        ConfigError: when `config` has no ``model_type`` or an unknown one or a bad setting,
            `pretrained` is not a local model directory, or the model cannot hold the data's
            vocabulary or sequence length.
    """
    _needs("transformers")
    from transformers import AutoModelForCausalLM

    if pretrained is not None:
        model = AutoModelForCausalLM.from_pretrained(_local_dir(pretrained), local_files_only=True)
        _check_pretrained(model, pretrained, vocab_size, "data.block_size", block_size)
        return HFModel(model, tokenizer_json)
    settings = dict(config or {})
    kind = settings.pop("model_type", None)
    if kind is None:
        raise ConfigError("model.config needs a model_type (e.g. model.config.model_type=gpt2)")
    for key, value in (("bos_token_id", eos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None:
            settings.setdefault(key, value)
    hf_config = _auto_config(kind, vocab_size=vocab_size, **settings)
    _check_positions(hf_config, "model.config", "data.block_size", block_size)
    return HFModel(AutoModelForCausalLM.from_config(hf_config), tokenizer_json)


def sequence_classifier(
    vocab_size: int,
    num_classes: int,
    config: Mapping[str, Any] | None = None,
    pretrained: str | None = None,
    tokenizer_json: str | None = None,
    pad_token_id: int | None = None,
    max_length: int | None = None,
) -> HFModel:
    """A sequence classifier: ``AutoModelForSequenceClassification.from_config`` of ``config``
    (``model_type`` and its settings), with the data's vocabulary and ``num_labels`` = the data's
    classes; or ``from_pretrained`` of a local directory (its head resized to the classes).

    Args:
        vocab_size: the data's vocabulary size.
        num_classes: the data's number of classes.
        config: ``model_type`` and that model type's settings; not used with `pretrained`.
        pretrained: a local ``save_pretrained`` directory to load instead.
        tokenizer_json: the data's tokenizer, kept with the model.
        pad_token_id: the padding token, set as the config's ``pad_token_id`` unless `config` sets it.
        max_length: the data's sequence length, checked against the model's positions.

    Returns:
        The model, wrapped in ``HFModel``.

    Raises:
        ConfigError: when `config` has no ``model_type`` or an unknown one or a bad setting,
            `pretrained` is not a local model directory, or the model cannot hold the data's
            vocabulary or sequence length.
    """
    _needs("transformers")
    from transformers import AutoModelForSequenceClassification

    if pretrained is not None:
        model = AutoModelForSequenceClassification.from_pretrained(
            _local_dir(pretrained),
            num_labels=num_classes,
            ignore_mismatched_sizes=True,
            local_files_only=True,
        )
        _check_pretrained(model, pretrained, vocab_size, "data.max_length", max_length)
        return HFModel(model, tokenizer_json)
    settings = dict(config or {})
    kind = settings.pop("model_type", None)
    if kind is None:
        raise ConfigError("model.config needs a model_type (e.g. model.config.model_type=bert)")
    if pad_token_id is not None:
        settings.setdefault("pad_token_id", pad_token_id)
    hf_config = _auto_config(kind, vocab_size=vocab_size, num_labels=num_classes, **settings)
    _check_positions(hf_config, "model.config", "data.max_length", max_length)
    return HFModel(AutoModelForSequenceClassification.from_config(hf_config), tokenizer_json)
