"""Character-level language modelling: a corpus from CPython's own documentation, a GRU
language model with its own train/eval steps, and a hook that writes samples after training.

The model computes its loss itself (cross-entropy over every position), so the configured
``criterion`` is not used; a metric such as ``torchmetrics.text.Perplexity`` reads the (B, T, V)
logits against the (B, T) targets.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from expkit.core.errors import ConfigError
from expkit.core.stages import Priority
from expkit.data import DataModule, check_fractions
from expkit.hooks.base import Hook

if TYPE_CHECKING:
    from expkit.engine.runner import Runner

__all__ = ["CharCorpusData", "CharGRU", "CharWindows", "TextSampleHook", "load_pydoc_topics"]


log = logging.getLogger("expkit")


def load_pydoc_topics() -> str:
    """The text of ``pydoc_data.topics.topics`` (the help() topics of the Python docs, about
    465K characters), joined in sorted-key order so it is the same on every run.

    Returns:
        The topics' texts, joined.

    Raises:
        ConfigError: when this Python lacks ``pydoc_data``.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise ConfigError(
            "data=char_corpus reads the Python documentation topics in the standard-library package "
            f"pydoc_data, which this Python lacks ({e}); install a full CPython (some distributions split "
            "it into a separate package, e.g. python3-doc / libpython3-stdlib)"
        ) from e
    return "".join(topics[key] for key in sorted(topics))


class CharWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` characters of ``codes``; item i is
    (x, y) = (window[:-1], window[1:]), both int64 of length ``seq_len``. A tail shorter
    than a window is dropped.

    Args:
        codes: the encoded text, one int64 code per character.
        seq_len: the length of each input and target sequence.
    """

    def __init__(self, codes: torch.Tensor, seq_len: int) -> None:
        self.seq_len = seq_len
        n = len(codes) // (seq_len + 1)
        self.windows = codes[: n * (seq_len + 1)].reshape(n, seq_len + 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[index]
        return window[:-1], window[1:]


class CharCorpusData(DataModule):
    """A character-level corpus: the first ``max_chars`` characters of the Python
    documentation topics that ship with every CPython (``pydoc_data.topics``; text under
    the PSF licence), split contiguously into train, then val, then test.

    The alphabet is the sorted set of characters in the used text (about 100); characters
    are encoded as their index in it (int64). Items are non-overlapping windows:
    (x, y) = (chars[i : i + seq_len], chars[i + 1 : i + seq_len + 1]).
    ``describe()`` (after ``datasets()``) gives ``vocab_size`` and ``alphabet``.

    Args:
        seq_len: the length of each input and target sequence, in characters.
        max_chars: the number of characters of the text used.
        val_fraction: the share of the text for validation.
        test_fraction: the share of the text for test (0: no test set).
        **kwargs (Any): the ``DataModule`` arguments (``batch_size``, ``num_workers``, ...).

    Raises:
        ConfigError: when `seq_len` or `max_chars` is less than 1, or the fractions are out of range.
    """

    def __init__(
        self,
        seq_len: int = 64,
        max_chars: int = 300_000,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {seq_len}")
        if max_chars < 1:
            raise ConfigError(f"data.max_chars must be >= 1, got {max_chars}")
        check_fractions(val_fraction, test_fraction)
        self.seq_len = seq_len
        self.max_chars = max_chars
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.alphabet = ""

    def datasets(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """The train, validation and test windows; sets the alphabet.

        Returns:
            A ``CharWindows`` for each split; the test set is None when it holds no window.

        Raises:
            ConfigError: when the train or validation split is shorter than one window.
        """
        text = load_pydoc_topics()[: self.max_chars]
        self.alphabet = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(self.alphabet)}
        codes = torch.tensor([index[c] for c in text], dtype=torch.long)
        n = len(codes)
        n_val, n_test = int(self.val_fraction * n), int(self.test_fraction * n)
        n_train = n - n_val - n_test
        splits = [codes[:n_train], codes[n_train : n_train + n_val], codes[n_train + n_val :]]
        for name, part in zip(("train", "val"), splits):
            if len(part) < self.seq_len + 1:
                raise ConfigError(
                    f"data.char_corpus: the {name} split has {len(part)} characters, fewer than one window of "
                    f"seq_len + 1 = {self.seq_len + 1}; raise data.max_chars or lower data.seq_len"
                )
        train, val, test = (CharWindows(part, self.seq_len) for part in splits)
        return train, val, test if len(test) > 0 else None

    def describe(self) -> dict[str, Any]:
        """What a model needs to know of the data, by constructor-argument name; the alphabet
        is known once ``datasets()`` has run.

        Returns:
            ``vocab_size`` (the alphabet's size) and ``alphabet``.

        Raises:
            RuntimeError: when ``datasets()`` has not run yet.
        """
        if not self.alphabet:
            raise RuntimeError("CharCorpusData.describe() needs the alphabet: call loaders() or datasets() first")
        return {"vocab_size": len(self.alphabet), "alphabet": self.alphabet}


class CharGRU(nn.Module):
    """Embedding, a GRU and a linear read-out: next-character logits at every position.

    forward: (B, T) int64 -> logits (B, T, vocab_size). ``train_step`` / ``eval_step``
    compute the mean cross-entropy over all B*T positions (nats per character). ``alphabet``
    (index -> character) is needed only by ``generate``.

    Args:
        vocab_size: the number of distinct characters.
        alphabet: the character of each index (empty: ``generate`` is unavailable).
        embed_dim: the size of the character embeddings.
        hidden_size: the GRU's hidden size.
        num_layers: the number of stacked GRU layers.
        dropout: the dropout probability between GRU layers and before the read-out.

    Raises:
        ValueError: when `alphabet` is given and its length is not `vocab_size`.
    """

    def __init__(
        self,
        vocab_size: int,
        alphabet: str = "",
        embed_dim: int = 64,
        hidden_size: int = 256,
        num_layers: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if alphabet and len(alphabet) != vocab_size:
            raise ValueError(f"alphabet has {len(alphabet)} characters but vocab_size={vocab_size}")
        self.vocab_size = vocab_size
        self.alphabet = alphabet
        self.embed = nn.Embedding(vocab_size, embed_dim)
        # GRU dropout acts between stacked layers only; self.drop covers the read-out
        self.gru = nn.GRU(
            embed_dim, hidden_size, num_layers, batch_first=True, dropout=dropout if num_layers > 1 else 0.0
        )
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden_size, vocab_size)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_with_state(x, state)[0]

    def forward_with_state(
        self, x: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) and the GRU's final state (num_layers, B, hidden_size).

        Args:
            x: the character codes, shape (B, T), int64.
            state: the GRU's state to start from; None: zeros.

        Returns:
            The logits and the GRU's final state.
        """
        h, state = self.gru(self.embed(x), state)
        return self.out(self.drop(h)), state

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        """The loss for the optimizer: mean cross-entropy over every position of the batch.

        Args:
            batch: (inputs, targets), each of shape (B, T).

        Returns:
            The ``loss`` and the ``logits``.
        """
        x, y = batch
        logits = self(x)
        return {"loss": F.cross_entropy(logits.reshape(-1, self.vocab_size), y.reshape(-1)), "logits": logits}

    def eval_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        """Validation/test: the mean cross-entropy, the (B, T, V) logits and the (B, T) targets.

        Args:
            batch: (inputs, targets), each of shape (B, T).

        Returns:
            The ``loss``, the ``logits`` and the ``targets``.
        """
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, self.vocab_size), y.reshape(-1))
        return {"loss": loss, "logits": logits, "targets": y}

    @torch.no_grad()
    def generate(
        self, prompt: str, length: int, temperature: float = 0.8, generator: torch.Generator | None = None
    ) -> str:
        """The prompt followed by ``length`` sampled characters. Characters of the prompt that
        are not in the alphabet are skipped; an empty prompt starts from a random character.
        ``temperature`` divides the logits (lower: more conservative); 0 takes the argmax.

        Args:
            prompt: the text to continue.
            length: the number of characters to generate.
            temperature: the sampling temperature; 0 or less takes the most likely character.
            generator: the CPU generator to sample from; None: torch's global generator.

        Returns:
            The prompt's characters in the alphabet (or the random first one) followed by the
                generated ones.

        Raises:
            ValueError: when the model has no alphabet.
        """
        if not self.alphabet:
            raise ValueError("CharGRU.generate needs the alphabet: build the model with alphabet=... (data.describe())")
        index = {c: i for i, c in enumerate(self.alphabet)}
        was_training = self.training
        self.eval()
        try:
            device = self.out.weight.device
            codes = [index[c] for c in prompt if c in index]
            if not codes:
                codes = [int(torch.randint(self.vocab_size, (1,), generator=generator))]
            # the sampling generator lives on the CPU: draw from CPU probabilities
            logits, state = self.forward_with_state(torch.tensor([codes], device=device))
            last = logits[0, -1]
            out: list[str] = [self.alphabet[i] for i in codes]
            for _ in range(length):
                if temperature <= 0:
                    nxt = int(last.argmax())
                else:
                    probs = torch.softmax(last.float().cpu() / temperature, dim=-1)
                    nxt = int(torch.multinomial(probs, 1, generator=generator))
                out.append(self.alphabet[nxt])
                logits, state = self.forward_with_state(torch.tensor([[nxt]], device=device), state)
                last = logits[0, -1]
            return "".join(out)
        finally:
            self.train(was_training)


class TextSampleHook(Hook):
    """After training, samples ``samples`` texts of ``length`` characters from the model's
    ``generate(prompt, length, temperature, generator)``, seeded by ``seed`` (the same weights
    give the same texts), logs them and writes them to ``work_dir/samples.txt``. Main process
    only; a model without ``generate`` gets a warning and no samples.

    Args:
        prompt: the text each sample starts with.
        length: the number of characters generated for each sample.
        temperature: the sampling temperature (0: the most likely character each time).
        samples: the number of samples.
        seed: the seed of the sampling generator.

    Raises:
        ValueError: when `length` is negative or `samples` is less than 1.
    """

    priority = Priority.NORMAL

    def __init__(
        self, prompt: str = "The ", length: int = 200, temperature: float = 0.8, samples: int = 3, seed: int = 0
    ) -> None:
        if length < 0 or samples < 1:
            raise ValueError(f"length must be >= 0 and samples >= 1, got length={length}, samples={samples}")
        self.prompt, self.length, self.temperature, self.samples, self.seed = prompt, length, temperature, samples, seed

    def after_train(self, runner: Runner) -> None:
        if not runner.is_main and not runner.sharded:  # (sharded: every rank takes part in the forward passes)
            return
        generate = getattr(runner.model, "generate", None)
        if not callable(generate):
            log.warning("TextSampleHook: %s has no generate(); no samples written", type(runner.model).__name__)
            return
        g = torch.Generator().manual_seed(self.seed)
        texts = [
            generate(self.prompt, self.length, temperature=self.temperature, generator=g) for _ in range(self.samples)
        ]
        if not runner.is_main:
            return
        path = runner.work_dir / "samples.txt"
        header = f"prompt={self.prompt!r} length={self.length} temperature={self.temperature} seed={self.seed}"
        body = "\n\n".join(f"--- sample {i + 1} ---\n{t}" for i, t in enumerate(texts))
        path.write_text(f"{header}\n\n{body}\n", encoding="utf-8")
        for i, text in enumerate(texts):
            first = text.splitlines()[:3]  # a few lines each in the log; the whole text is in the file
            log.info("sample %d/%d: %s", i + 1, self.samples, " | ".join(first))
        log.info("samples written to %s", path)

    def __repr__(self) -> str:
        return f"TextSampleHook(prompt={self.prompt!r}, length={self.length}, samples={self.samples})"
