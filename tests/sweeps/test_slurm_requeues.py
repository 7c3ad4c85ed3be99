"""The part of ``launch_through_requeues`` that reads submitit's error, on the installed submitit (the
whole path, a node set DOWN under a two-node sweep job, is in tests/cluster/test_slurm_nodes.py)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow


def test_the_job_id_is_read_from_a_real_uncompleted_job_error_and_nothing_else(tmp_path):
    submitit = pytest.importorskip("submitit")
    from hydra_plugins.expkit_sweeper._slurm_requeues import launch_through_requeues, uncompleted_job

    job = submitit.LocalExecutor(folder=tmp_path / "%j").submit(os._exit, 3)  # as a job whose node went away: no result
    with pytest.raises(submitit.core.utils.UncompletedJobError) as raised:
        job.results()  # (submitit waits its 15 s for the result file first)
    assert uncompleted_job(raised.value) == job.job_id
    assert uncompleted_job(RuntimeError(f"Job {job.job_id} (task: 0) has not produced any output")) is None

    class NotSlurm:  # a launch that returns is returned as it is
        def launch(self, job_overrides, initial_job_idx):
            return [(list(o), initial_job_idx) for o in job_overrides]

    assert launch_through_requeues(NotSlurm(), [["a=1"]], 4) == [(["a=1"], 4)]
