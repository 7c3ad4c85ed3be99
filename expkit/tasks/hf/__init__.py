"""Hugging Face models, tokenizers and datasets (``pip install 'expkit[hf]'``), without any
download: models are built from a config (or a local ``from_pretrained`` directory),
tokenizers are trained on local text (or read from a local ``tokenizer.json``), text is read
through ``datasets`` from local files or the Python documentation that ships with CPython.

- ``TextBlocks``: a causal-LM data module: text -> a BPE tokenizer (``tokenizers``) ->
  token ids (``datasets``, cached beside the work dirs, not in the home dir) -> fixed-length
  blocks; batches are dicts (``input_ids``, ``labels``).
- ``causal_lm``: ``AutoModelForCausalLM.from_config`` (or ``from_pretrained`` of a local dir)
  sized to the tokenizer; wrapped in ``HFModel``.
- ``HFModel``: any ``transformers`` PreTrainedModel as an expkit model: dict batches passed as
  keyword arguments, the loss from the model's output, logits (shifted for a causal LM) for
  the metrics, ``generate`` for samples. ``expkit.config.build`` wraps a bare PreTrainedModel in it.
- ``SavePretrained`` and ``SampleText`` hooks: the trained model in transformers' own form
  (``save_pretrained``: config + safetensors, with the tokenizer), and generated samples
  after each validation.

The package, a module a concern: ``tokenizer`` (the BPE tokenizer; what the rest shares),
``text_blocks`` (``TextBlocks``), ``text_classes`` (``TextClasses``), ``models`` (``HFModel``,
``causal_lm``, ``sequence_classifier``), ``hooks`` (``SavePretrained``, ``SampleText``). Configs
and code name everything here, ``expkit.tasks.hf.<name>``.
"""

from expkit.tasks.hf.hooks import SampleText, SavePretrained, fast_tokenizer, write_pretrained
from expkit.tasks.hf.models import HFModel, causal_lm, is_transformers_model, sequence_classifier
from expkit.tasks.hf.text_blocks import TextBlocks
from expkit.tasks.hf.text_classes import STDLIB_PACKAGES, TextClasses
from expkit.tasks.hf.tokenizer import SPECIAL, bpe_tokenizer

__all__ = [
    "SPECIAL",
    "STDLIB_PACKAGES",
    "HFModel",
    "SampleText",
    "SavePretrained",
    "TextBlocks",
    "TextClasses",
    "bpe_tokenizer",
    "causal_lm",
    "fast_tokenizer",
    "is_transformers_model",
    "sequence_classifier",
    "write_pretrained",
]
