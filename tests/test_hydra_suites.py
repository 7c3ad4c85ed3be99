"""Hydra's own test suites for sweepers and launchers, run against expkit's sweeper
(hydra/sweeper=expkit) in Hydra's test apps: it registers with Hydra's ConfigStore as Hydra's
plugins do, so it works in any Hydra app, not only in expkit's commands. The suites expect
Hydra's legacy working-dir change (other tests here set version_base 1.3, which turns it off):
hydra.job.chdir=True says it explicitly."""

from __future__ import annotations

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite


@pytest.mark.parametrize(("launcher_name", "overrides"), [("basic", ["hydra/sweeper=expkit", "hydra.job.chdir=True"])])
class TestExpkitSweeperWithTheBasicLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"),
                         [("basic", ["hydra/sweeper=expkit", "hydra.sweeper.max_batch_size=2", "hydra.job.chdir=True"])])  # fmt: skip
class TestExpkitSweeperInBatches(BatchedSweeperTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({}, ["-m", "hydra/sweeper=expkit", "hydra/launcher=basic"])])  # fmt: skip
class TestExpkitSweeperIntegration(IntegrationTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({"defaults": [{"override hydra/sweeper": "expkit"}, "_self_"]}, ["-m"])])  # fmt: skip
class TestExpkitSweeperChosenInAPlainAppsConfig(IntegrationTestSuite):
    """The sweeper chosen the way a plain Hydra app's own config chooses one (its defaults list),
    not on expkit's command line: the jobs must still honour hydra.sweep.dir and subdir."""
