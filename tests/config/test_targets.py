"""expkit.config.targets.check_swept_values: a sweep job's values checked as its run checks them
before building, and nothing the run would accept refused."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from expkit.config.targets import check_swept_values
from expkit.core.errors import ConfigError

SGD = {"_target_": "torch.optim.SGD", "lr": 0.1}


@pytest.mark.parametrize(
    ("config", "overrides", "said"),
    [
        ({"optim": {**SGD, "lr": "abc"}}, ["optim.lr=abc"], "optim.lr='abc' is not a number"),
        ({"optim": {**SGD, "lr": float("nan")}}, ["optim.lr=nan"], "optim.lr=nan is not a finite number"),
        ({"optim": {**SGD, "_target_": "torch.optim.Sgd"}}, ["optim._target_=torch.optim.Sgd"], "cannot be imported"),
        # a node given whole: its arguments; a map's member (hooks.<name>) is a node the run builds
        ({"hooks": {"x": {**SGD, "lr": "abc"}}}, ["+hooks.x={_target_:torch.optim.SGD,lr:abc}"], "hooks.x.lr='abc'"),
        # the trainer's settings, built as the run builds them
        (
            {"trainer": {"max_epochs": "abc"}},
            ["trainer.max_epochs=abc"],
            "trainer.max_epochs must be a positive integer",
        ),
        ({"trainer": {"max_epoch": 3}}, ["+trainer.max_epoch=3"], "did you mean trainer.max_epochs"),
    ],
)
def test_a_value_the_run_refuses_is_refused_with_the_runs_words(config, overrides, said):
    with pytest.raises(ConfigError, match=said):
        check_swept_values(OmegaConf.create(config), overrides)


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        # inside a built node, Hydra builds the nested target unchecked, as the run does
        (
            {
                "model": {
                    "_target_": "torch.nn.Sequential",
                    "act": {"_target_": "torch.nn.Softplus", "threshold": "inf"},
                }
            },
            ["+model.act.threshold=inf"],
        ),
        ({"optim": {**SGD, "lr": "${oc.env:LR}"}}, ["optim.lr=${oc.env:LR}"]),  # (not resolved: it may need the run)
        ({"optim": {**SGD, "foo": "abc"}}, ["+optim.foo=abc"]),  # not an argument of the target
        ({"optim": {**SGD}, "trainer": {"max_epochs": 1}}, ["~optim.nesterov", "hydra.job.chdir=false"]),
        ({"model": {"_target_": "no_such_module.Net"}}, ["model._target_=no_such_module.Net"]),  # imports_here=False
        ({"trainer": {"max_epochs": "${data_info:epochs}"}}, ["trainer.max_epochs=${data_info:epochs}"]),  # (the run's)
    ],
)
def test_what_the_run_accepts_or_leaves_to_its_job_passes(config, overrides):
    check_swept_values(OmegaConf.create(config), overrides, imports_here=False)
    if "no_such_module" in str(config):  # the jobs run in this process: what does not import here does not there
        with pytest.raises(ConfigError, match="cannot be imported"):
            check_swept_values(OmegaConf.create(config), overrides, imports_here=True)
