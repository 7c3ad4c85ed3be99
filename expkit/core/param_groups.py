"""Parameter groups from ordered rules: ``optim.param_groups``, first match wins.

A rule has ``match`` and the settings of its group::

    optim:
      param_groups:
        - {match: "*.bias", weight_decay: 0.0}      # a glob on parameter names
        - {match: norm, weight_decay: 0.0}          # a kind of layer: norm, embedding
        - {match: "head.*", lr_mult: 10, name: head}   # name: for train/lr/<name> (default: the match)

Any optimizer argument (``lr``, ``weight_decay``, ``betas``, ...) sets the group's value;
``lr_mult`` / ``decay_mult`` multiply the optimizer's own ``lr`` / ``weight_decay``. Each
parameter goes to the first rule it matches (MMEngine's ``paramwise_cfg`` combines several
matching keys in an order users find hard to predict, mmengine#846); parameters no rule
matches form the first group, with the optimizer's settings. Groups keep the order of the
rules and, inside a group, the model's parameter order, so optimizer state resumes.
"""

from __future__ import annotations

import fnmatch
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from expkit.core.activation_checkpointing import parameter_name
from expkit.core.errors import ConfigError

__all__ = ["KINDS", "build_param_groups"]


log = logging.getLogger("expkit")

KINDS: dict[str, tuple[type[nn.Module], ...]] = {
    "norm": tuple(
        t
        for t in (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None))
        if t is not None
    ),
    "embedding": (nn.Embedding, nn.EmbeddingBag),
}
_RULE_KEYS = ("match", "name", "lr_mult", "decay_mult")


def _kind_params(model: nn.Module, kind: str) -> set[str]:
    """Names of the parameters that modules of `kind` own directly."""
    return {
        parameter_name(f"{module_name}.{p}" if module_name else p)
        for module_name, module in model.named_modules()
        if isinstance(module, KINDS[kind])
        for p, _ in module.named_parameters(recurse=False)
    }


def _optimizer_arguments(factory: Callable) -> tuple[set[str], dict[str, Any]]:
    """(the optimizer's argument names, its settings: the factory's keywords over its defaults)."""
    func = getattr(factory, "func", factory)
    keywords = dict(getattr(factory, "keywords", {}) or {})
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return set(keywords), keywords
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    return set(params) - {"params", "self"}, {**defaults, **keywords}


def build_param_groups(
    model: nn.Module, rules: Sequence[Mapping[str, Any]], factory: Callable, key: str = "optim.param_groups"
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups for `model` under `rules`; logs one line per group.

    Args:
        model: the module whose parameters are grouped.
        rules: the rules in order, each with ``match`` (a glob on parameter names, or a kind in
            ``KINDS``), optionally ``name``, ``lr_mult``, ``decay_mult``, and any optimizer argument.
        factory: the optimizer factory (a ``functools.partial`` or class); its arguments and settings
            decide which rule keys are valid and what ``lr_mult`` / ``decay_mult`` multiply.
        key: the rules' config key, named in error messages.

    Returns:
        The groups for the optimizer, each with ``params``, ``name`` and its settings: first a
        ``default`` group of the parameters no rule matched (when there are any), then one per rule
        that matched a parameter, in the rules' order. A rule that matches nothing is skipped with a
        warning.

    Raises:
        ConfigError: when a rule has no string ``match``, has a key that is neither a rule key nor an
            optimizer argument, or multiplies an ``lr`` / ``weight_decay`` the optimizer lacks as a number.
    """
    accepted, settings = _optimizer_arguments(factory)
    named = [(parameter_name(n), p) for n, p in model.named_parameters()]  # (activation checkpointing's steps left out)
    owner: dict[str, int] = {}  # parameter name -> rule index (first match wins)
    groups: list[dict[str, Any]] = []
    for i, rule in enumerate(rules):
        where = f"{key}[{i}]"
        if not isinstance(rule, Mapping) or not isinstance(rule.get("match"), str):
            raise ConfigError(
                f'{where}: a rule needs match: a glob on parameter names ("*.bias", "head.*") or a '
                f"kind of layer ({', '.join(KINDS)}); got {rule!r}"
            )
        unknown = [k for k in rule if k not in _RULE_KEYS and k not in accepted]
        if unknown:
            raise ConfigError(
                f"{where}: {', '.join(map(repr, unknown))} is not an argument of the optimizer; use "
                f"{', '.join(sorted(accepted))}, or lr_mult / decay_mult / name"
            )
        pattern = rule["match"]
        chosen = _kind_params(model, pattern) if pattern in KINDS else None
        matched = [
            n
            for n, _ in named
            if n not in owner and (n in chosen if chosen is not None else fnmatch.fnmatchcase(n, pattern))
        ]
        group: dict[str, Any] = {k: v for k, v in rule.items() if k not in _RULE_KEYS}
        for mult, name in (("lr_mult", "lr"), ("decay_mult", "weight_decay")):
            if mult in rule:
                if name not in settings or not isinstance(settings[name], (int, float)):
                    raise ConfigError(f"{where}.{mult}: the optimizer has no numeric {name} to multiply")
                group[name] = settings[name] * float(rule[mult])
        group["name"] = str(
            rule.get("name") or pattern.replace("*", "").strip(".") or f"group{i}"
        )  # logged: train/lr/<name>
        if not matched:
            log.warning(
                "%s (match: %s) matches no parameter that an earlier rule left over; it is ignored. "
                "Parameter names look like: %s",
                where,
                pattern,
                ", ".join(n for n, _ in named[:4]),
            )
            continue
        owner.update(dict.fromkeys(matched, i))
        groups.append({**group, "_names": matched})
    rest = [n for n, _ in named if n not in owner]
    if rest:
        groups.insert(0, {"name": "default", "_names": rest})
    by_name = dict(named)
    result = []
    for group in groups:
        names = group.pop("_names")
        group["params"] = [by_name[n] for n in names]
        shown = {k: v for k, v in group.items() if k not in ("params", "name")} or "the optimizer's settings"
        count = sum(p.numel() for p in group["params"])
        log.info("Parameter group %s: %s (%d tensors, %s parameters)", group["name"], shown, len(names), f"{count:,}")
        result.append(group)
    return result
