"""A sweep job is identified by what it computes, never by the keys that only control the run."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from expkit.core.hydra_compat import INIT_KWARGS
from expkit.sweeps.sweep_jobs import COMPUTE_KEYS, CONTROL_KEYS, job_identity, key_kind

CONF_DIR = REPO / "expkit" / "conf"


def _leaves(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node and "_target_" not in node:
        return [k for key, value in node.items() for k in _leaves(value, f"{prefix}{key}.")]
    if isinstance(node, dict):  # an object: its own settings too
        return [prefix.rstrip(".")] + [f"{prefix}{k}" for k in node if k != "_target_"]
    return [prefix.rstrip(".")]


def test_every_key_of_train_yaml_and_every_group_is_classified():
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        cfg = compose(config_name="train", overrides=["hooks=[ema]", "logger=[tensorboard]"], return_hydra_config=True)
    keys = _leaves(OmegaConf.to_container(cfg, resolve=False))
    groups = [p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")]
    groups += ["hydra/launcher", "hydra/sweeper", "hydra/job_logging"]
    unclassified = [k for k in keys + groups if key_kind(k) is None]
    assert not unclassified
    assert not set(CONTROL_KEYS) & set(COMPUTE_KEYS)
    assert key_kind("trainer.max_epochs") == key_kind("model") == key_kind("hooks.ema.momentum") == "compute"
    assert key_kind("retry_failed") == key_kind("hydra.launcher.n_jobs") == key_kind("hydra/launcher") == "control"
    assert key_kind("default_hooks.checkpoint.max_keep_ckpts") == "control"
    assert key_kind("default_hooks.checkpoint.save_best") == "compute"  # (the best checkpoint is tested)


def test_control_keys_never_make_another_job():
    job = ["optim.lr=0.1", "model=cnn"]
    assert job_identity(
        [
            *job,
            "resume=true",
            "retry_failed=true",
            "fail_fast=true",
            "logger=[tensorboard]",
            "default_hooks.logger.interval=5",
            "+hydra.job.env_set.X=1",
            "hydra/launcher=joblib",
            "hparams_search=optuna",
        ]
    ) == sorted(job)
    assert job_identity([*job, "trainer.seed=1"]) != job_identity(job)


@pytest.mark.slow
def test_retry_failed_runs_again_only_the_failed_job_in_its_own_dir(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "optim.lr=0.1,-1,0.05", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"]
    first = run_cli(*args)
    assert first.returncode == 0, first.output  # a failed job is recorded; the sweep goes on
    results = {j: json.loads((sweep / j / "result.json").read_text()) for j in "012"}
    assert [results[j]["status"] for j in "012"] == ["completed", "failed", "completed"]
    stamps = {j: (sweep / j / "result.json").stat().st_mtime_ns for j in "02"}

    again = run_cli(*args, "resume=true", "retry_failed=true")
    assert again.returncode == 0, again.output
    assert sorted(p.name for p in sweep.iterdir() if not p.name.startswith(".") and p.is_dir()) == ["0", "1", "2"]
    assert (sweep / "0" / "result.json").stat().st_mtime_ns == stamps["0"]  # completed: not trained again
    assert (sweep / "2" / "result.json").stat().st_mtime_ns == stamps["2"]
    assert (sweep / "1" / "train.log").read_text().count("Invalid learning rate") == 2  # the failed one ran again
    assert json.loads((sweep / "1" / "result.json").read_text())["status"] == "failed"  # (lr=-1 fails again)


def test_a_torn_or_foreign_result_json_counts_as_no_result_and_a_skipped_job_as_skipped(tmp_path):
    # (issue 53, item 16: a truncated or non-dict result.json raised; fail_fast's skipped jobs were
    # counted as interrupted)
    from expkit.sweeps.sweep_jobs import JOB_FILE, best_value, job_result, tally_jobs
    from expkit.workdir.records import read_result

    for name, text in (("0", '{"status": "compl'), ("1", "[1, 2]"), ("2", '"completed"'), ("3", "\udcff")):
        job = tmp_path / name
        job.mkdir()
        (job / JOB_FILE).write_text(json.dumps({"overrides": [f"optim.lr={name}"]}))
        (job / "result.json").write_bytes(text.encode("utf-8", "surrogateescape"))
        assert job_result(job) is None and read_result(job) is None, name
    job = tmp_path / "4"
    job.mkdir()
    (job / JOB_FILE).write_text(json.dumps({"overrides": ["optim.lr=4"]}))
    (job / "result.json").write_text(json.dumps({"status": "skipped", "error": "an earlier job failed"}))
    assert tally_jobs(tmp_path) == {"completed": 0, "interrupted": 4, "failed": 0, "skipped": 1}
    assert best_value({"best_metrics": {"val/acc": "0.5"}}, "val/acc", "greater") == -1e30  # (the worst)


def test_hparams_search_null_is_neither_a_search_nor_a_sweep():
    from expkit.config.cli import searching, sweeping

    assert not searching(["hparams_search=null"]) and not sweeping(["hparams_search=null"])
    assert searching(["hparams_search=optuna"]) and sweeping(["hparams_search=optuna"])
    assert sweeping(["-m", "hparams_search=null"])


def test_rank_and_local_rank_read_slurms_variables_under_a_plain_srun(monkeypatch):
    from expkit.core import distributed

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "SUBMITIT_EXECUTOR"):
        # set, then deleted: monkeypatch records them and removes what _from_slurm sets after the test
        # (a name deleted while absent is not recorded, and WORLD_SIZE=4 leaked into later tests)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        monkeypatch.setenv(name, value)
    assert (distributed.rank(), distributed.local_rank(), distributed.world_size()) == (3, 1, 4)
