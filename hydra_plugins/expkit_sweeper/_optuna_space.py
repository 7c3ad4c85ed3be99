"""The Optuna sweeper's search space: Hydra's sweep syntax as Optuna distributions (and a trial's
values back as overrides), the fixed overrides beside it, a GridSampler's grid, and the check
that a study holds one search."""

import importlib
import json
from decimal import Decimal
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hydra_plugins.expkit_sweeper._optuna_settings import SearchConfigError

__all__ = ["SEARCH_ATTR", "SearchSpace", "distribution", "override_value"]


SEARCH_ATTR = "expkit_search"  # the study's user attribute that records its search space


def distribution(value: Any) -> Any:
    """The Optuna distribution of a Hydra sweep value: interval (``tag(log, ...)`` for a log
    scale, ``tag(int, ...)`` for integers), range (Hydra's: the stop is excluded) or choice.

    Args:
        value: a parsed sweep (``Override.value()``): an ``IntervalSweep``, a ``RangeSweep`` or a
            ``ChoiceSweep``.

    Returns:
        An interval: a ``FloatDistribution``, or an ``IntDistribution`` with ``int`` (its ends truncated
            to integers); both log-scaled with ``log``. A range: an ``IntDistribution`` when start, stop
            and step are all ints, else a ``FloatDistribution``, from its lowest to its highest value with
            the step's absolute value (a negative step is allowed). A choice: a ``CategoricalDistribution``
            of its values, a list or dict value as its override text (``[1,2]``).

    Raises:
        ValueError: when a range holds no value or has a step of 0, or `value` is not an interval, range or
            choice sweep.
    """
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if step == 0:
            raise ValueError(f"range({start}, {stop}, 0) has a step of 0; give a step that is not 0")
        count = sum(1 for _ in value.range())  # as many values as Hydra's own sweep of it runs
        if count < 1:
            raise ValueError(f"range({start}, {stop}, {step}) holds no value")
        if all(isinstance(x, int) for x in (start, stop, step)):
            last = start + step * (count - 1)
            return IntDistribution(min(start, last), max(start, last), step=abs(step))
        # the ends in decimal, as typed: start + 3 * 0.3 in binary floats is 0.8999999999999999, which
        # Optuna's step check (in decimal) rounds down to 0.6, losing a value of the range
        ends = (Decimal(str(start)), Decimal(str(start)) + Decimal(str(step)) * (count - 1))
        return FloatDistribution(float(min(ends)), float(max(ends)), step=abs(float(step)))
    if isinstance(value, ChoiceSweep):
        primitive = (type(None), bool, int, float, str)
        return CategoricalDistribution(
            [v if isinstance(v, primitive) else Override._get_value_element_as_str(v) for v in value.list]
        )
    raise ValueError(f"{value!r} is not interval(...), range(...) or choice(...)")


def override_value(value: Any) -> str:
    """The override text (the part after ``=``) of a value a trial took.

    Args:
        value: a value from ``trial.params``: a number, bool, None or string; a list or dict choice
            comes as its override text (see ``distribution``).

    Returns:
        A string starting with ``[`` or ``{`` as it is; any other value as Hydra writes an override
            value (``null`` for None, special characters of a string escaped).
    """
    from hydra.core.override_parser.types import Override

    if isinstance(value, str) and value[:1] in "[{":  # a list or dict choice, kept as its override text
        return value
    return Override._get_value_element_as_str(value)


class SearchSpace:
    """The search-space part of ``OptunaSweeper``: ``params`` and the command line parsed, and a
    trial's overrides."""

    config: DictConfig | None
    params: dict[str, Any]
    custom_search_space: str | None
    study_name: str

    def _space(self, arguments: list[str]) -> tuple[list[str], dict[str, Any]]:
        """Fixed overrides and the search space, from ``params`` then the command line (wins)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        fixed: dict[str, str] = {}
        space: dict[str, Any] = {}
        for override in parser.parse_overrides(lines):
            key = override.get_key_element()
            fixed.pop(key, None)
            space.pop(key, None)
            if override.is_sweep_override():
                try:
                    space[key] = distribution(override.value())
                except ValueError as exc:
                    raise SearchConfigError(
                        f"hydra.sweeper.params.{key}={override.input_line.partition('=')[2]}: {exc}"
                    ) from None
            else:
                fixed[key] = override.input_line
        return list(fixed.values()), space

    def _overrides(self, trial: Any, space: dict[str, Any]) -> list[str]:
        if self.custom_search_space:
            module, _, name = self.custom_search_space.rpartition(".")
            getattr(importlib.import_module(module), name)(self.config, trial)  # suggests more params
        return [f"{k}={override_value(v)}" for k, v in trial.params.items()]

    @staticmethod
    def _grid(spec: Any, space: dict[str, Any]) -> Any:
        """A GridSampler without a ``search_space``: the grid of the search space's choices and
        ranges (an interval has no grid: refused, naming it)."""
        from optuna.distributions import CategoricalDistribution

        if not str(spec.get("_target_", "")).endswith("GridSampler") or spec.get("search_space") is not None:
            return spec
        grid: dict[str, list[Any]] = {}
        for key, dist in space.items():
            if isinstance(dist, CategoricalDistribution):
                grid[key] = list(dist.choices)
            elif getattr(dist, "step", None) is not None:
                count = round((dist.high - dist.low) / dist.step) + 1
                grid[key] = [dist.low + i * dist.step for i in range(count)]
                if isinstance(dist.low, float):
                    grid[key] = [round(v, 12) for v in grid[key]]
            else:
                raise SearchConfigError(
                    f"hydra/sweeper/sampler=grid: {key} is an interval, which has no grid; give it as "
                    f"choice(...) or range(...), or give hydra.sweeper.sampler.search_space"
                )
        if not grid:
            raise SearchConfigError("hydra/sweeper/sampler=grid: the search space is empty (hydra.sweeper.params)")
        return {**OmegaConf.to_container(spec, resolve=True), "search_space": grid}  # type: ignore[dict-item]

    def _same_search(self, study: Any, storage: str, space: dict[str, Any]) -> None:
        """A study is one search: its space (and custom_search_space) is recorded in the study by
        the first search; another search pointed at the same study name stops here (exit 2)."""
        from optuna.distributions import distribution_to_json

        mine = {
            "params": {k: json.loads(distribution_to_json(d)) for k, d in sorted(space.items())},
            "custom_search_space": self.custom_search_space,
        }
        theirs = study.user_attrs.get(SEARCH_ATTR)
        if theirs is None:
            study.set_user_attr(SEARCH_ATTR, mine)
        elif theirs != mine:
            raise SearchConfigError(
                f"study {self.study_name!r} in {storage} is another search: its space is "
                f"{_space_text(theirs)}; this one's is {_space_text(mine)}. Give this search "
                "another hydra.sweeper.study_name (or the same space)"
            )


def _space_text(search: dict[str, Any]) -> str:
    params = search.get("params") or {}
    text = ", ".join(f"{k}: {v.get('name', '?')}{v.get('attributes', '')}" for k, v in params.items())
    custom = search.get("custom_search_space")
    return "{" + text + "}" + (f" + {custom}" if custom else "")
