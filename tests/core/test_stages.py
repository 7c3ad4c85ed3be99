"""Stages and priorities: the contract every hook relies on."""

from __future__ import annotations

import inspect

import pytest

from expkit import Hook, Priority, Stage, get_priority
from expkit.core.stages import priority_name

MMENGINE_STAGES = [
    "before_run",
    "after_load_checkpoint",
    "before_train",
    "before_train_epoch",
    "before_train_iter",
    "after_train_iter",
    "after_train_epoch",
    "before_val",
    "before_val_epoch",
    "before_val_iter",
    "after_val_iter",
    "after_val_epoch",
    "after_val",
    "before_save_checkpoint",
    "after_train",
    "before_test",
    "before_test_epoch",
    "before_test_iter",
    "after_test_iter",
    "after_test_epoch",
    "after_test",
    "after_run",
]


def test_stage_list_equals_hook_methods():
    methods = {
        name
        for name, value in vars(Hook).items()
        if inspect.isfunction(value) and not name.startswith("_") and name not in ("state_dict", "load_state_dict")
    }
    assert methods == {s.value for s in Stage}


def test_stages_cover_mmengine_and_the_finer_points():
    values = [s.value for s in Stage]
    assert set(MMENGINE_STAGES) <= set(values)
    extra = set(values) - set(MMENGINE_STAGES)
    assert extra == {"after_forward", "after_backward", "after_optimizer_step", "after_save_checkpoint", "on_exception"}


def test_every_stage_is_in_the_pseudocode_docstring():
    import expkit.core.stages

    doc = expkit.core.stages.__doc__
    for stage in Stage:
        assert stage.name in doc, stage


def test_hook_payloads_are_keyword_only():
    for stage in Stage:
        params = list(inspect.signature(getattr(Hook, stage.value)).parameters.values())
        assert [p.name for p in params[:2]] == ["self", "runner"]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), stage


def test_nine_levels_with_mmengine_values():
    assert {p.name: p.value for p in Priority} == {
        "HIGHEST": 0,
        "VERY_HIGH": 10,
        "HIGH": 30,
        "ABOVE_NORMAL": 40,
        "NORMAL": 50,
        "BELOW_NORMAL": 60,
        "LOW": 70,
        "VERY_LOW": 90,
        "LOWEST": 100,
    }


@pytest.mark.parametrize(
    "given, expected",
    [
        ("HIGHEST", 0),
        ("very_low", 90),
        ("Below_Normal", 60),
        (Priority.LOW, 70),
        (0, 0),
        (55, 55),
        (100, 100),
        ("42", 42),
    ],
)
def test_get_priority_accepts_names_members_and_ints(given, expected):
    assert get_priority(given) == expected


@pytest.mark.parametrize("given", ["SUPER", 101, -1, "101"])
def test_get_priority_rejects_with_the_choices(given):
    with pytest.raises(ValueError) as err:
        get_priority(given)
    assert "VERY_HIGH (10)" in str(err.value) and "0-100" in str(err.value)


@pytest.mark.parametrize("given", [1.5, None, True])
def test_get_priority_rejects_other_types(given):
    with pytest.raises(TypeError):
        get_priority(given)


def test_priority_name():
    assert priority_name(50) == "NORMAL"
    assert priority_name(55) == "55"
