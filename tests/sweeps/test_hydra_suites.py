"""Hydra's own test suites for sweepers and launchers, run against expkit's sweeper
(hydra/sweeper=expkit) in Hydra's test apps: it registers with Hydra's ConfigStore as Hydra's
plugins do, so it works in any Hydra app, not only in expkit's commands. The suites expect
Hydra's legacy working-dir change (other tests here set version_base 1.3, which turns it off):
hydra.job.chdir=True says it explicitly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite
from hydra.test_utils.test_utils import integration_test
from omegaconf import OmegaConf


@pytest.mark.parametrize(("launcher_name", "overrides"), [("basic", ["hydra/sweeper=expkit", "hydra.job.chdir=True"])])
class TestExpkitSweeperWithTheBasicLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(
    ("launcher_name", "overrides"),
    [("basic", ["hydra/sweeper=expkit", "hydra.sweeper.max_batch_size=2", "hydra.job.chdir=True"])],
)
class TestExpkitSweeperInBatches(BatchedSweeperTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task_launcher_cfg", "extra_flags"), [({}, ["-m", "hydra/sweeper=expkit", "hydra/launcher=basic"])]
)
class TestExpkitSweeperIntegration(IntegrationTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task_launcher_cfg", "extra_flags"), [({"defaults": [{"override hydra/sweeper": "expkit"}, "_self_"]}, ["-m"])]
)
class TestExpkitSweeperChosenInAPlainAppsConfig(IntegrationTestSuite):
    """The sweeper chosen the way a plain Hydra app's own config chooses one (its defaults list),
    not on expkit's command line: the jobs must still honour hydra.sweep.dir and subdir."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task_launcher_cfg", "extra_flags"),
    [({}, ["-m", "hydra/sweeper=optuna", "hydra/launcher=basic", "hydra.sweeper.n_trials=1"])],
)
class TestOptunaSweeperIntegration(IntegrationTestSuite):
    """expkit's Optuna sweeper in Hydra's test apps: job dirs, task names, working dirs. (The
    launcher and batch suites check grid sweeps, every combination once and in order, which a
    sampler does not promise; hydra-optuna-sweeper does not run them either.)"""

    def test_to_absolute_path_multirun(self, tmpdir: Path, task_launcher_cfg: Any, extra_flags: list[str]) -> None:
        """Hydra's version runs the same search twice into one sweep dir and expects the second
        run's job in cli_dir_0 again. A search's job dirs are named by trial number, and the
        second run continues the study in that dir (trial 1), so its job is cli_dir_1: a search
        run again never overwrites a trial's dir."""
        overrides = [
            *extra_flags,
            "hydra.job.chdir=True",
            "hydra.sweep.dir=cli_dir",
            "hydra.sweep.subdir=cli_dir_${hydra.job.num}",
        ]
        cfg = OmegaConf.create(task_launcher_cfg or {})
        integration_test(
            tmpdir=tmpdir,
            task_config=cfg,
            overrides=overrides,
            prints="hydra.utils.to_absolute_path('/foo/bar')",
            expected_outputs=str(Path("/foo/bar").absolute()),
        )
        for run in (1, 2):
            integration_test(
                tmpdir=tmpdir,
                task_config=cfg,
                overrides=overrides,
                prints=["hydra.utils.to_absolute_path('foo/bar')", "os.getcwd()"],
                expected_outputs=[
                    os.path.realpath(str(Path(tmpdir) / "foo/bar")),
                    str(Path(tmpdir) / f"cli_dir/cli_dir_{run}"),
                ],
            )
