"""Metrics and the one notion of "better".

A metric is any object with ``update`` / ``compute`` / ``reset``: expkit's own (``Metric``
subclasses, accumulated on the device, combined over DDP ranks by ``sync()``) or a
torchmetrics metric or ``MetricCollection`` (which synchronise inside ``compute()``).
``MetricSlot`` gives one configured metric what the eval step produced, by name, and turns
its result into Python floats (a dict result becomes ``<name>/<key>``).

Which direction is better comes from one place, ``Directions.rule(key)``: a setting made
once per metric (``metrics.<name>.higher_is_better``, or a hook's explicit ``rule``), then
the metric object's own ``higher_is_better`` (torchmetrics sets it), then the name rules
(MMEngine's word lists: acc, f1, ... are greater; loss, error, perplexity ... are less).
Best tracking, ``save_best``, early stopping, the plateau scheduler, the sweep summary and
the value returned to Hydra's sweepers all ask it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from expkit.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that use it, none of them per batch: "better" and the monitored key
# (sweep summaries, compare, a command's --help) need no torch

__all__ = [
    "DEFAULT_INPUTS",
    "GREATER_KEYS",
    "LESS_KEYS",
    "PROBE_SAMPLES",
    "RULES",
    "Accuracy",
    "Directions",
    "Metric",
    "MetricSlot",
    "as_slots",
    "better",
    "infer_rule",
    "monitor_of",
    "probe_batch",
    "probe_metrics",
    "rule_of_flag",
    "worst_value",
]


# MMEngine's defaults: a key containing one of these is better when greater / less
GREATER_KEYS = ("acc", "top", "AR@", "auc", "precision", "mAP", "mDice", "mIoU", "mAcc", "aAcc", "f1", "recall")
LESS_KEYS = ("loss", "error", "err", "perplexity")
RULES = ("greater", "less")


def infer_rule(
    key: str, greater_keys: Iterable[str] = GREATER_KEYS, less_keys: Iterable[str] = LESS_KEYS
) -> str | None:
    """'greater' or 'less' for a metric name such as 'val/acc' by name alone; None when it cannot tell.

    The last part of the key (after the last ``/``) is compared case-insensitively: first for
    an exact match with a listed word, then for a listed word contained in it, greater words
    before less words.

    Args:
        key: the metric key, e.g. ``val/acc`` or ``val/noisy/loss``.
        greater_keys: the words of metrics that are better when greater.
        less_keys: the words of metrics that are better when less.

    Returns:
        ``"greater"``, ``"less"``, or None when no word matches.
    """
    name = key.rsplit("/", 1)[-1].lower()
    for keys, rule in ((greater_keys, "greater"), (less_keys, "less")):
        if name in (k.lower() for k in keys):
            return rule
    for keys, rule in ((greater_keys, "greater"), (less_keys, "less")):
        if any(k.lower() in name for k in keys):
            return rule
    return None


def better(value: float, best: float | None, rule: str, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` under `rule` by more than `min_delta`. NaN never wins;
    anything (but NaN) beats no best at all.

    Args:
        value: the new value.
        best: the best value so far; None when there is none yet.
        rule: ``"greater"`` or ``"less"`` (any other value is read as ``"less"``).
        min_delta: the margin by which `value` must beat `best`.

    Returns:
        True when `value` is not NaN and beats `best` by more than `min_delta`, or `best` is None.
    """
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best + min_delta if rule == "greater" else value < best - min_delta


def worst_value(rule: str) -> float:
    """What a failed or diverged job returns to a sweeper: never NaN (it crashes Optuna).

    Args:
        rule: ``"greater"`` or ``"less"``.

    Returns:
        -1e30 when greater is better, else 1e30.
    """
    return -1e30 if rule == "greater" else 1e30


def rule_of_flag(higher_is_better: Any) -> str | None:
    """True -> 'greater', False -> 'less', anything else (None, unset) -> None.

    Args:
        higher_is_better: a ``higher_is_better`` setting or attribute.

    Returns:
        ``"greater"``, ``"less"`` or None.
    """
    return {True: "greater", False: "less"}.get(higher_is_better) if isinstance(higher_is_better, bool) else None


class Metric:
    """expkit's metric protocol: update(preds, targets) per batch; compute() -> float once per
    pass; reset(). ``sync()`` combines the counts of all DDP ranks before compute (a metric
    that synchronises inside compute(), as torchmetrics' do, need not subclass this)."""

    higher_is_better: bool | None = None

    def reset(self) -> None:
        """Forget everything accumulated (called before each pass)."""
        raise NotImplementedError

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        """Accumulate one batch, on the device (no host sync).

        Args:
            preds: the model's predictions for the batch (e.g. logits).
            targets: the batch's targets.
        """
        raise NotImplementedError

    def compute(self) -> float:
        """The value over every batch since the last reset (after ``sync()`` under DDP).

        Returns:
            The metric's value.
        """
        raise NotImplementedError

    def sync(self) -> None:
        """Combine the counts of all DDP ranks (before compute); a no-op in one process."""

    @staticmethod
    def sum_over_ranks(*values: Any) -> list[float]:
        """The sums over all DDP ranks of these numbers (as float64); the numbers in one process.

        Args:
            *values: numbers or one-element tensors (this rank's counts).

        Returns:
            The sum over all ranks of each value, in order, as floats.
        """
        import torch

        from expkit.core.distributed import all_reduce_sum, is_distributed, reduce_device

        if not is_distributed():
            return [float(v) for v in values]
        totals = torch.tensor([float(v) for v in values], dtype=torch.float64, device=reduce_device())
        all_reduce_sum(totals)
        return totals.tolist()


class Accuracy(Metric):
    """Top-k classification accuracy in [0, 1].

    Args:
        top_k: a prediction counts as correct when the target is among its `top_k` highest scores.

    Raises:
        ValueError: when `top_k` is less than 1.
    """

    higher_is_better = True

    def __init__(self, top_k: int = 1) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.reset()

    def reset(self) -> None:
        self.correct: torch.Tensor | int = 0
        self.total = 0

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        if self.top_k == 1:
            hits = preds.argmax(dim=-1) == targets
        else:
            hits = (preds.topk(self.top_k, dim=-1).indices == targets.unsqueeze(-1)).any(dim=-1)
        correct = hits.sum()
        self.correct = self.correct + (correct.item() if correct.is_cpu else correct)  # no device sync per batch
        self.total += targets.numel()

    def compute(self) -> float:
        """The accuracy since the last reset.

        Returns:
            The share of targets among their predictions' top `top_k` scores; NaN before any batch.
        """
        return float(self.correct) / self.total if self.total else float("nan")

    def sync(self) -> None:
        correct, total = self.sum_over_ranks(self.correct, self.total)
        self.correct, self.total = correct, int(total)


DEFAULT_INPUTS = ("preds", "targets")
_FALLBACK = {"preds": "logits"}  # a step that returns no "preds" is read through its "logits"


def _scalar(name: str, value: Any) -> float:
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"metrics.{name} computed a tensor of shape {tuple(value.shape)}, not one number; configure it to "
                "reduce (for torchmetrics e.g. average: macro, or num_outputs: 1) or wrap it in a metric that does"
            )
        return float(value.detach().float().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"metrics.{name} computed a {type(value).__name__} ({value!r:.80}); a metric must compute a "
        "number, a one-element tensor, or a dict of those"
    )


class MetricSlot:
    """One configured metric: the object, which step outputs its ``update`` gets, its direction.

    ``inputs``: the names of the eval step's outputs passed to ``update``, in order (a list),
    or as keyword arguments (a mapping ``{argument: output name}``). By default
    ``[preds, targets]``, where ``preds`` falls back to ``logits``.
    ``higher_is_better``: the direction, set once here; None takes the metric's own attribute.

    Args:
        metric: the metric object: anything with ``update``, ``compute`` and ``reset``.
        name: the metric's name in the config (``metrics.<name>``), used in keys and messages.
        inputs: the step outputs passed to ``update``, as described above; None: ``[preds, targets]``.
        higher_is_better: the metric's direction; None takes the metric's own attribute.

    Raises:
        ConfigError: when the metric lacks ``update``, ``compute`` or ``reset``, `higher_is_better` is
            not a bool or None, or `inputs` is not a non-empty list or mapping.
    """

    def __init__(
        self,
        metric: Any,
        name: str = "metric",
        inputs: Sequence[str] | Mapping[str, str] | None = None,
        higher_is_better: bool | None = None,
    ) -> None:
        missing = [m for m in ("update", "compute", "reset") if not callable(getattr(metric, m, None))]
        if missing:
            raise ConfigError(
                f"metrics.{name} ({type(metric).__name__}) has no {', '.join(missing)}: a metric needs "
                "update(), compute() and reset() (torchmetrics metrics have them)"
            )
        if higher_is_better is not None and not isinstance(higher_is_better, bool):
            raise ConfigError(f"metrics.{name}.higher_is_better={higher_is_better!r}: use true, false or null")
        self.metric, self.name = metric, name
        self.higher_is_better = higher_is_better
        if inputs is None:
            inputs = DEFAULT_INPUTS
        if isinstance(inputs, str) or not isinstance(inputs, (Sequence, Mapping)) or not inputs:
            raise ConfigError(
                f"metrics.{name}.inputs={inputs!r}: give a list of step outputs ([preds, targets]) "
                "or a mapping of update() arguments to outputs ({preds: logits, target: targets})"
            )
        self.keywords = dict(inputs) if isinstance(inputs, Mapping) else None
        self.positional = None if self.keywords is not None else tuple(inputs)
        self._read: tuple[str, ...] = self.positional or ()  # the output names read (fallbacks resolved)

    # -- the per-batch call --------------------------------------------------------------------
    def _get(self, outputs: Mapping[str, Any], key: str) -> Any:
        return outputs[self._key(outputs, key)]

    def _key(self, outputs: Mapping[str, Any], key: str) -> str:
        """The output `key` is read from: itself, or its fallback (``preds``: ``logits``)."""
        if key in outputs:
            return key
        fallback = _FALLBACK.get(key)
        if fallback is not None and fallback in outputs:
            return fallback
        raise ConfigError(
            f"metrics.{self.name} reads {key!r} from the eval step's outputs, which has "
            f"{sorted(outputs)}; set metrics.{self.name}.inputs to the outputs it needs"
        )

    def update(self, outputs: Mapping[str, Any]) -> None:
        """Update the metric with the eval step's outputs it is configured to read (``inputs``).

        Args:
            outputs: the eval step's outputs by name.

        Raises:
            ConfigError: when an output the metric reads is missing (and has no fallback).
        """
        if self.keywords is None:  # the names resolved at the first batch, read without a Python call each
            try:
                values = list(map(outputs.__getitem__, self._read))
            except KeyError:  # the first batch (or outputs named otherwise since): resolve the fallbacks
                self._read = tuple(self._key(outputs, key) for key in self.positional)  # type: ignore[union-attr]
                values = [outputs[key] for key in self._read]
            self.metric.update(*values)
        else:
            self.metric.update(**{arg: self._get(outputs, key) for arg, key in self.keywords.items()})

    def reset(self) -> None:
        """Reset the metric (before each pass); its inputs are resolved again at the next batch."""
        self.metric.reset()
        self._read = self.positional or ()

    def sync(self) -> None:
        """expkit's own metrics combine their counts here; others synchronise in compute()."""
        if isinstance(self.metric, Metric):
            self.metric.sync()

    def compute(self) -> dict[str, float]:
        """``{"": value}`` for a number, ``{"/key": value, ...}`` for a dict result (flattened).

        Returns:
            The metric's values as floats, by the suffix to append to the metric's key.

        Raises:
            ConfigError: when the metric computes something other than a number, a one-element
                tensor, or a (nested) dict of those.
        """
        return _flatten("", self.metric.compute(), self.name)

    # -- what it reports, and which way is better ------------------------------------------------
    def reported_names(self) -> tuple[list[str], bool]:
        """(the suffixes compute() will report as far as known before the first pass, whether
        ``<name>/<key>`` keys may appear too). A collection's members are known; expkit's own
        metrics report one number; any other object may return a dict.

        Returns:
            The suffixes known in advance (``""`` for one number, ``"/<key>"`` for a collection's
                members), and whether other ``<name>/<key>`` keys may appear.
        """
        members = _members(self.metric)
        if members is not None:
            return [f"/{key}" for key in members], False
        return [""], not isinstance(self.metric, Metric)

    def rule(self, suffix: str = "") -> str | None:
        """The direction of the value at `suffix`: this slot's setting, then the object's own.

        Args:
            suffix: the suffix of the value's key (``""``, or ``"/<member>"`` of a collection).

        Returns:
            ``"greater"``, ``"less"``, or None when neither the slot nor the object says.
        """
        explicit = rule_of_flag(self.higher_is_better)
        if explicit is not None:
            return explicit
        members = _members(self.metric)
        if suffix and members is not None and suffix[1:] in members:
            return rule_of_flag(getattr(members[suffix[1:]], "higher_is_better", None))
        return rule_of_flag(getattr(self.metric, "higher_is_better", None))

    def to(self, device: torch.device) -> MetricSlot:
        """The metric moved to `device` when it is a module (torchmetrics); returns self.

        Args:
            device: the device to move the metric to.

        Returns:
            This slot.
        """
        import torch

        if isinstance(self.metric, torch.nn.Module):
            self.metric.to(device)
        return self


def _flatten(prefix: str, value: Any, name: str) -> dict[str, float]:
    if isinstance(value, Mapping):
        return {k: v for key, sub in value.items() for k, v in _flatten(f"{prefix}/{key}", sub, name).items()}
    return {prefix: _scalar(f"{name}{prefix}", value)}


def _members(metric: Any) -> Mapping[str, Any] | None:
    """A torchmetrics MetricCollection's members by the keys its compute() reports, else None."""
    if metric.__class__.__name__ != "MetricCollection" or not hasattr(metric, "keys"):
        return None
    try:
        return {key: metric[key] for key in metric.keys(keep_base=False)}
    except TypeError:  # older torchmetrics: keys() without keep_base
        return dict(metric.items())


class Directions:
    """The direction of every metric key of one run, from one place (see the module docstring).

    ``declare(key, rule, by)`` records a rule a hook was given explicitly (MMEngine's ``rule``
    parameters); a rule set on the metric itself wins over inference, and two explicit rules
    that disagree are an error naming both settings.

    Args:
        slots: the run's metrics by name.
        sets: the names of the named evaluation sets by mode (``{"val": ["clean", "noisy"]}``),
            whose keys read ``<mode>/<set>/<metric>``; None: no named sets.
    """

    def __init__(self, slots: Mapping[str, MetricSlot], sets: Mapping[str, Sequence[str]] | None = None) -> None:
        self.slots = slots
        self.sets = {mode: list(names) for mode, names in (sets or {}).items()}  # named sets: val/<set>/<metric>
        self.declared: dict[str, tuple[str, str]] = {}  # key -> (rule, the setting that gave it)
        self._rules: dict[str, str | None] = {}  # rule() by key, worked out again after a declare()

    def _slot(self, key: str) -> tuple[MetricSlot | None, str]:
        """The slot a key such as val/f1, val/scores/f1 or val/noisy/f1 belongs to, and the
        suffix ('' or /f1)."""
        _, _, name = key.partition("/")
        first, _, rest = name.partition("/")
        if rest and first in self.sets.get(key.partition("/")[0], ()):
            name = rest
        for metric_name, slot in self.slots.items():
            if name == metric_name or name.startswith(metric_name + "/"):
                return slot, name[len(metric_name) :]
        return None, ""

    def explicit(self, key: str) -> tuple[str, str] | None:
        """(rule, the setting) when the user set the direction of `key` explicitly.

        Args:
            key: a metric key such as ``val/acc``.

        Returns:
            The rule and the name of the setting that gave it (the metric's ``higher_is_better``
                first, then a declared rule), or None when nothing set it explicitly.
        """
        slot, _ = self._slot(key)
        rule = None if slot is None else rule_of_flag(slot.higher_is_better)
        if rule is not None:
            return rule, f"metrics.{slot.name}.higher_is_better"  # type: ignore[union-attr]
        return self.declared.get(key)

    def declare(self, key: str, rule: str, by: str) -> None:
        """Record an explicit `rule` for `key`, given by setting `by`; a contradiction is a ConfigError.

        Args:
            key: the metric key the rule is for.
            rule: ``"greater"`` or ``"less"``.
            by: the setting that gave the rule, named in error messages.

        Raises:
            ConfigError: when `rule` is neither ``greater`` nor ``less``, or contradicts an explicit
                rule already set for `key`.
        """
        if rule not in RULES:
            raise ConfigError(f"{by}={rule!r}: use greater or less")
        known = self.explicit(key)
        if known is not None and known[0] != rule:
            raise ConfigError(
                f"{by}={rule} contradicts {known[1]} ({known[0]} is better) for {key}: set the direction "
                f"once, with metrics.<name>.higher_is_better"
            )
        self.declared.setdefault(key, (rule, by))
        self._rules.clear()

    def rule(self, key: str) -> str | None:
        """'greater', 'less', or None when nothing says. Asked for every key after every
        validation (best values): worked out once per key, about 100 Python calls each.

        Args:
            key: a metric key such as ``val/acc``.

        Returns:
            The explicit rule, else the metric object's own, else the rule inferred from the name;
                None when none of them says.
        """
        try:
            return self._rules[key]
        except KeyError:
            rule = self._rules[key] = self._work_out(key)
            return rule

    def _work_out(self, key: str) -> str | None:
        known = self.explicit(key)
        if known is not None:
            return known[0]
        slot, suffix = self._slot(key)
        if slot is not None:
            own = slot.rule(suffix)
            if own is not None:
                return own
        return infer_rule(key)  # val/loss included: "loss" is a less-is-better name

    def require(self, key: str, by: str) -> str:
        """The rule of `key`, or a ConfigError saying how to set it.

        Args:
            key: a metric key such as ``val/acc``.
            by: the setting that needs the rule, named in the error message.

        Returns:
            ``"greater"`` or ``"less"``.

        Raises:
            ConfigError: when nothing tells the direction of `key`.
        """
        rule = self.rule(key)
        if rule is None:
            slot, _ = self._slot(key)
            fix = (
                f"set metrics.{slot.name}.higher_is_better=true or false"
                if slot is not None
                else f"set the rule where {by} is set"
            )
            raise ConfigError(f"{by}={key}: cannot tell whether {key} is better greater or less; {fix}")
        return rule

    def expected(self, mode: str = "val") -> tuple[list[str], list[str]]:
        """(the keys validation will report, prefixes under which more keys may appear).

        Args:
            mode: the evaluation mode, ``"val"`` or ``"test"``.

        Returns:
            The keys known in advance (the loss and each metric's, per named set), and the
                prefixes of metrics whose keys are known only once they compute.
        """
        keys, open_prefixes = [], []
        for prefix in [f"{mode}/{s}" for s in self.sets.get(mode, ())] or [mode]:
            keys.append(f"{prefix}/loss")
            for name, slot in self.slots.items():
                suffixes, more = slot.reported_names()
                keys += [f"{prefix}/{name}{suffix}" for suffix in suffixes]
                if more:
                    open_prefixes.append(f"{prefix}/{name}/")
        return keys, open_prefixes

    def track_best(self, best: dict[str, dict[str, Any]], metrics: Mapping[str, float], epoch: int, it: int) -> None:
        """Update `best` (key -> value, epoch, iter, rule) with the keys of `metrics` that beat
        it; a key nothing gives a direction is not tracked (monitored keys are checked at start-up).

        Args:
            best: the best values so far by key, updated in place: ``{"value", "epoch", "iter", "rule"}``.
            metrics: the new values by key.
            epoch: the epoch the values were computed at.
            it: the iteration the values were computed at.
        """
        for key, value in metrics.items():
            rule = self.rule(key)
            if rule is not None and better(value, best[key]["value"] if key in best else None, rule):
                best[key] = {"value": value, "epoch": epoch, "iter": it, "rule": rule}

    def check_reported(self, key: str, by: str, mode: str = "val") -> None:
        """A ConfigError at start-up when `key` is not a metric validation will report.

        Args:
            key: the metric key a setting names (e.g. the monitored one).
            by: the setting that names it, for the error message.
            mode: the evaluation mode whose keys are checked.

        Raises:
            ConfigError: when `key` is neither a key the mode reports nor under a prefix where more
                keys may appear.
        """
        keys, open_prefixes = self.expected(mode)
        if key in keys or any(key.startswith(p) for p in open_prefixes):
            return
        listed = ", ".join(keys + [p + "..." for p in open_prefixes])
        raise ConfigError(
            f"{by}={key!r} is not a metric that validation reports; it reports: {listed}. "
            "Add a metric with metrics.<name>={_target_: ...} or pick one of these."
        )


def as_slots(metrics: Mapping[str, Any]) -> dict[str, MetricSlot]:
    """Every metric in a MetricSlot (default inputs, its own direction), slots kept as they are.

    Args:
        metrics: metric objects or ``MetricSlot``s by name.

    Returns:
        A ``MetricSlot`` by name (as a string).

    Raises:
        ConfigError: when a metric lacks ``update``, ``compute`` or ``reset``.
    """
    return {str(name): m if isinstance(m, MetricSlot) else MetricSlot(m, str(name)) for name, m in metrics.items()}


def _check_classes(outputs: Any, classes: int) -> None:
    """A classifier whose logits have another number of classes than the data (a 1000-class
    head on 10 classes trains, and its metrics look plausible): refused, naming both."""
    import torch

    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    if not isinstance(logits, torch.Tensor) or logits.ndim not in (2, 4) or logits.shape[1] == classes:
        return  # ([batch, classes], or [batch, classes, height, width] for segmentation)
    raise ConfigError(
        f"the model outputs {logits.shape[1]} classes (logits of shape {list(logits.shape[1:])} a sample) but the data has "
        f"{classes}: set model.num_classes={classes} (or model.num_classes=${{data_info:num_classes}}), or the "
        "model's own argument for the size of its head"
    )


def probe_metrics(runner: Any) -> None:
    """Every metric of `runner` updated and computed once, on copies, with the first two
    validation samples (``probe_batch``): a metric that does not fit the data (top_k=20 on 10
    classes, a wrong num_classes) fails at start-up, naming it, instead of after the first
    epoch; so does a model whose logits have another number of classes than the data
    describes. Leaves the run's random state, cuDNN's settings and the metrics as they were.

    Args:
        runner: the Runner about to train (its model, metrics, validation loader and the data's
            ``num_classes`` are read).

    Raises:
        ConfigError: when a metric fails on the first validation batch, or the model's logits
            have another number of classes than the data.
    """
    import copy

    import torch

    from expkit.core.rng import rng_states, set_rng_states

    r = runner
    classes = getattr(r, "data_info", {}).get("num_classes")
    if not r.metrics and not isinstance(classes, int):
        return
    loader = next(iter(r.val_loader.values())) if isinstance(r.val_loader, Mapping) else r.val_loader
    states, was_training = rng_states(), r.model.training
    benchmark = torch.backends.cudnn.benchmark
    try:
        batch = probe_batch(loader)
        if batch is None:
            return
        r.model.eval()
        # (a batch of two is a shape training never has: cuDNN's benchmark would time every
        # convolution's kernels for it, a second or more of a ResNet's start-up on a GPU)
        torch.backends.cudnn.benchmark = False
        with torch.no_grad(), r.autocast():
            outputs = r.eval_step(r.to_device(batch))
        if isinstance(classes, int):
            _check_classes(outputs, classes)
        for name, slot in r.metrics.items():
            probe = copy.deepcopy(slot)
            probe.reset()
            try:
                probe.update(outputs)
                probe.compute()
            except ConfigError:
                raise
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise ConfigError(
                    f"metrics.{name} ({type(slot.metric).__name__}) fails on the first validation batch: "
                    f"{type(exc).__name__}: {first[:200]}. Check its settings against the data "
                    f"(e.g. top_k, num_classes) and metrics.{name}.inputs"
                ) from None
    finally:
        torch.backends.cudnn.benchmark = benchmark
        r.model.train(was_training)
        set_rng_states(states)


PROBE_SAMPLES = 2  # two, not one: a model that squeezes its batch dimension works on any real batch but one


def probe_batch(loader: Any) -> Any:
    """The first samples of `loader` as one batch, read and collated in this process: what the
    metric probe needs, without starting the loader's workers (with persistent workers, the next
    pass would first wait for every batch they had read ahead, a whole validation's worth) and
    without reading a whole batch.

    Args:
        loader: a DataLoader, or any iterable of batches.

    Returns:
        A batch of the first ``PROBE_SAMPLES`` samples in the loader's order (an iterable dataset:
            the first it yields), collated by the loader's ``collate_fn``; the loader's first batch
            when it is no DataLoader that batches samples; None when it holds no sample.
    """
    from itertools import islice

    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return next(iter(loader), None)
    if isinstance(loader.dataset, IterableDataset):
        samples = list(islice(iter(loader.dataset), PROBE_SAMPLES))
    else:
        indices = next(iter(loader.batch_sampler), [])  # type: ignore[arg-type]  # (the loader's order, this rank's share)
        samples = [loader.dataset[i] for i in list(indices)[:PROBE_SAMPLES]]
    return loader.collate_fn(samples) if samples else None


def monitor_of(config: dict[str, Any] | None) -> tuple[str, str]:
    """The job's monitored metric and its rule as far as its config tells (before the run
    decided it: a run records the rule it used as result.json's ``monitor_rule``, which wins).

    Args:
        config: the job's config as a plain dict (e.g. its ``.hydra/config.yaml``); None reads as
            an empty one.

    Returns:
        The monitored key (``monitor``, default ``val/acc``) and its rule: the metric's
            ``higher_is_better``, else the checkpoint hook's ``rule``, else inferred from the name,
            else ``"greater"``.
    """
    config = config or {}
    monitor = str(config.get("monitor") or "val/acc")
    metrics = config.get("metrics") or {}
    # val/acc, val/noisy/acc (a named set), val/f1/cat (one key of a metric's dict): the last name that is a metric
    metric = next((metrics[part] for part in reversed(monitor.split("/")[1:]) if part in metrics), None)
    rule = rule_of_flag(metric.get("higher_is_better")) if isinstance(metric, dict) else None
    if rule is None:
        rule = ((config.get("default_hooks") or {}).get("checkpoint") or {}).get("rule")
        rule = (rule[0] if rule else None) if isinstance(rule, list) else rule
    return monitor, rule or infer_rule(monitor) or "greater"
