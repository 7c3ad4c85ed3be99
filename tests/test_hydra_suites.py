"""Hydra's own test suites for sweepers and launchers, run against expkit's sweeper
(hydra/sweeper=expkit) in Hydra's test apps: it registers with Hydra's ConfigStore as Hydra's
plugins do, so it works in any Hydra app, not only in expkit's commands."""

from __future__ import annotations

import pytest
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite


@pytest.mark.parametrize(("launcher_name", "overrides"), [("basic", ["hydra/sweeper=expkit"])])
class TestExpkitSweeperWithTheBasicLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"),
                         [("basic", ["hydra/sweeper=expkit", "hydra.sweeper.max_batch_size=2"])])  # fmt: skip
class TestExpkitSweeperInBatches(BatchedSweeperTestSuite):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({}, ["-m", "hydra/sweeper=expkit", "hydra/launcher=basic"])])  # fmt: skip
class TestExpkitSweeperIntegration(IntegrationTestSuite):
    pass
