"""expkit's Optuna sweeper (hparams_search=optuna): real studies in sqlite and journal files,
real pruning, real joblib workers, a real optuna-dashboard server."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import optuna
import pytest
from conftest import assert_svg_reads_right, run_cli
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hydra_plugins.expkit_sweeper.optuna_sweeper import distribution

FAST = ["hparams_search=optuna", "trainer.max_epochs=1", "data.batch_size=64"]
LR_WIDE = "hydra.sweeper.params={optim.lr: 'tag(log, interval(0.00001, 1.0))'}"
MEDIAN = "+hydra.sweeper.pruner={_target_: optuna.pruners.MedianPruner, n_startup_trials: 2}"


def _study(storage: str, name: str) -> optuna.Study:
    from expkit.sweeps.search import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def _rows(sweep: Path) -> list[dict]:
    return list(csv.DictReader((sweep / "summary.csv").open()))


def _validations(work: Path) -> int:
    return sum("val/acc" in json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines())


def test_hydra_sweep_syntax_maps_to_optuna_distributions():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def parse(text: str):
        return distribution(OverridesParser.create().parse_override(f"x={text}").value())

    assert parse("tag(log, interval(0.001, 0.5))") == FloatDistribution(0.001, 0.5, log=True)
    assert parse("interval(1, 4)") == FloatDistribution(1.0, 4.0)
    assert parse("tag(int, interval(1, 4))") == IntDistribution(1, 4)
    assert parse("range(1, 10, 2)") == IntDistribution(1, 9, step=2)  # Hydra's range: 10 excluded
    assert parse("range(0.0, 1.0, 0.25)") == FloatDistribution(0.0, 0.75, step=0.25)
    assert parse("range(0, 1, 0.3)") == FloatDistribution(0.0, 0.9, step=0.3)  # (not cut to 0.6)
    assert parse("range(1, 0, -0.3)") == FloatDistribution(0.1, 1.0, step=0.3)
    assert parse("choice(sgd, adam)") == CategoricalDistribution(["sgd", "adam"])
    assert parse("choice([128,128], [256])") == CategoricalDistribution(["[128,128]", "[256]"])
    with pytest.raises(ValueError, match="holds no value"):
        parse("range(5, 1)")
    with pytest.raises(ValueError, match="step of 0"):  # (was a ZeroDivisionError's traceback)
        parse("range(0, 10, 0)")


@pytest.mark.slow
def test_a_stored_study_continues_and_the_trial_count_adds_up(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    for n, sweep in ((6, "a"), (4, "b")):
        proc = run_cli(
            *FAST,
            f"hydra.sweeper.n_trials={n}",
            f"hydra.sweeper.storage={storage}",
            "hydra.sweeper.study_name=s",
            f"hydra.sweep.dir={tmp_path / sweep}",
        )
        assert proc.returncode == 0, proc.output
    study = _study(storage, "s")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 10
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE  # val/acc: greater, by the one rule
    ledger = json.loads((tmp_path / "b" / "optuna_trials.json").read_text())["trials"]
    assert sorted(map(int, ledger)) == [6, 7, 8, 9]  # the second command's trials, in its own dir
    best = json.loads((tmp_path / "b" / "best.json").read_text())
    b_best = max(t.value for t in study.trials if t.number >= 6)
    assert best["value"] == pytest.approx(b_best)
    params = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(params)) == 10  # the second command's sampler continued: no trial of the first again


@pytest.mark.slow
def test_a_resumed_search_with_more_trials_explores_new_parameters(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*FAST, "hydra.sweeper.study_name=c", f"hydra.sweep.dir={sweep}"]
    first = run_cli(*args, "hydra.sweeper.n_trials=2")
    assert first.returncode == 0, first.output
    more = run_cli(*args, "hydra.sweeper.n_trials=4", "resume=true")
    assert more.returncode == 0, more.output
    trials = _study(str(sweep / "optuna.journal"), "c").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    params = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(params)) == 4, params  # trials 2 and 3 were copies of 0 and 1 (a sampler seeded again)
    ledger = json.loads((sweep / "optuna_trials.json").read_text())["trials"]
    assert sorted(int(e["job"]) for e in ledger.values()) == [0, 1, 2, 3]  # a job dir each
    assert len(_rows(sweep)) == 4  # the summary shows every trial


@pytest.mark.slow
@pytest.mark.long(seconds=72)
def test_pruning_stops_hopeless_trials_and_saves_epochs(tmp_path):
    common = ["hparams_search=optuna", "trainer.max_epochs=6", "hydra.sweeper.n_trials=8", LR_WIDE]
    storage = f"sqlite:///{tmp_path}/study.db"
    pruned_run = run_cli(
        *common,
        MEDIAN,
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=p",
        f"hydra.sweep.dir={tmp_path / 'pruned'}",
    )
    assert pruned_run.returncode == 0, pruned_run.output
    full_run = run_cli(*common, f"hydra.sweep.dir={tmp_path / 'full'}")
    assert full_run.returncode == 0, full_run.output

    rows = {r["job"]: r for r in _rows(tmp_path / "pruned")}
    pruned = [job for job, r in rows.items() if r["status"] == "pruned"]
    assert pruned, rows
    study = _study(storage, "p")
    states = {t.number: t.state for t in study.trials}
    for job in pruned:
        work = tmp_path / "pruned" / job
        result = json.loads((work / "result.json").read_text())
        assert states[result["optuna_trial"]] == TrialState.PRUNED  # told as pruned, not failed
        assert _validations(work) < 6 and list((work / "checkpoints").glob("*.pth"))
        assert "test/acc" not in result["final_metrics"]  # a pruned trial skips the test pass
    assert all(_validations(tmp_path / "pruned" / j) == 6 for j, r in rows.items() if r["status"] == "completed")
    epochs = {
        name: sum(_validations(p) for p in (tmp_path / name).iterdir() if (p / "metrics.jsonl").is_file())
        for name in ("pruned", "full")
    }
    assert epochs["full"] == 8 * 6 and epochs["pruned"] < epochs["full"]
    best = json.loads((tmp_path / "pruned" / "best.json").read_text())
    assert best["value"] == pytest.approx(study.best_value)
    assert best["statuses"]["pruned"] == len(pruned)
    assert "search progress" in (tmp_path / "pruned" / "sweep.svg").read_text()


@pytest.mark.slow
def test_two_joblib_workers_share_one_sqlite_study(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    proc = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=j",
        MEDIAN,
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert proc.returncode == 0, proc.output
    study = _study(storage, "j")
    assert sorted(t.number for t in study.trials) == [0, 1, 2, 3]
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)  # none failed or left running
    trials = [json.loads((tmp_path / "sweep" / str(j) / "result.json").read_text())["optuna_trial"] for j in range(4)]
    assert sorted(trials) == [0, 1, 2, 3]  # no trial lost, none run twice
    assert all(len(t.intermediate_values) == 1 for t in study.trials)  # each job reported from its worker process


EXIT_HOOK = """
import os
from pathlib import Path
from expkit import Hook

class ExitInTrial(Hook):
    '''SIGKILL-like death of the whole sweep in trial 1, once.'''

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        marker = runner.work_dir.parent / "killed"
        if os.environ["EXPKIT_OPTUNA_TRIAL"].split()[1] == "1" and runner.iter + 1 == 30 and not marker.exists():
            marker.touch()
            os._exit(9)
"""


@pytest.mark.slow
def test_sweep_resume_finishes_the_trial_a_dead_sweep_left_running(tmp_path):
    (tmp_path / "exithook.py").write_text(EXIT_HOOK)
    storage = str(tmp_path / "sweep" / "optuna.journal")  # by default, the sweep dir keeps its study
    args = [
        "hparams_search=optuna",
        "trainer.max_epochs=2",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.study_name=r",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "+hooks.exit._target_=exithook.ExitInTrial",
        "default_hooks.checkpoint.interval=1",
        "default_hooks.checkpoint.by_epoch=false",
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    killed = run_cli(*args, env=env)
    assert killed.returncode == 9, killed.output
    assert [t.state for t in _study(storage, "r").trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    resumed = run_cli(*args, "resume=true", env=env)
    assert resumed.returncode == 0, resumed.output
    study = _study(storage, "r")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3  # the count is the sweep's: 3
    result = json.loads((tmp_path / "sweep" / "1" / "result.json").read_text())
    assert result["status"] == "completed" and result["resumed_in_sweep"] and result["optuna_trial"] == 1
    assert result["best_metrics"]["val/acc"]["value"] == pytest.approx(study.trials[1].value)
    steps = [json.loads(line)["step"] for line in (tmp_path / "sweep" / "1" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.name.isdigit()) == ["0", "1", "2"]


@pytest.mark.slow
def test_direction_follows_monitor_and_a_bad_setting_is_named(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    proc = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=1",
        "monitor=val/loss",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=loss",
        f"hydra.sweep.dir={tmp_path / 'a'}",
    )
    assert proc.returncode == 0, proc.output
    assert _study(storage, "loss").direction == optuna.study.StudyDirection.MINIMIZE
    mse = run_cli(
        *FAST,
        "experiment=regression",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.params={optim.lr: 0.01}",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=mse",
        f"hydra.sweep.dir={tmp_path / 'r'}",
    )
    assert mse.returncode == 0, mse.output  # val/mse: torchmetrics' MeanSquaredError says lower is better
    assert _study(storage, "mse").direction == optuna.study.StudyDirection.MINIMIZE
    # a sweep dir holds one study's trials: another study aimed at it stops (the same study: one more worker)
    second = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=1",
        "monitor=val/loss",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=other",
        f"hydra.sweep.dir={tmp_path / 'a'}",
        "resume=true",
    )
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.output
    assert "holds the trials of study 'loss'" in second.stderr and "searches study 'other'" in second.stderr
    bad = run_cli(*FAST, "hydra.sweeper.direction=up", f"hydra.sweep.dir={tmp_path / 'b'}")
    assert bad.returncode == 2, bad.output
    assert "hydra.sweeper.direction=up" in bad.stderr and "Traceback" not in bad.stderr
    empty = run_cli(*FAST, "hydra.sweeper.params={optim.lr: 'range(5,1)'}", f"hydra.sweep.dir={tmp_path / 'b'}")
    assert empty.returncode == 2 and "hydra.sweeper.params.optim.lr=range(5,1)" in empty.stderr, empty.output
    assert "Traceback" not in empty.stderr
    clash = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.direction=maximize",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=loss",
        f"hydra.sweep.dir={tmp_path / 'c'}",
    )
    assert clash.returncode == 2, clash.output
    assert "study 'loss'" in clash.stderr and "minimizes" in clash.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_search_resumes_with_its_dir_spelled_absolute_as_the_stop_message_prints_it(tmp_path):
    """A search started with a relative hydra.sweep.dir is resumed by the command its Ctrl-C message
    prints, which gives the dir absolute: the sweep dir's own journal is one storage however spelled."""
    first = run_cli(*FAST, "hydra.sweeper.n_trials=1", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert first.returncode == 0, first.output
    again = run_cli(*FAST, "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={tmp_path / 'sweep'}", "resume=true")
    assert again.returncode == 0, again.output
    trials = _study(str(tmp_path / "sweep" / "optuna.journal"), "expkit").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2


@pytest.mark.slow
def test_optuna_dashboard_serves_the_study(tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    proc = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=2",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=d",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert proc.returncode == 0, proc.output
    port = _free_port()
    server = subprocess.Popen(  # python -m expkit.dashboard: the SQLite study the search recorded
        [sys.executable, "-m", "expkit.dashboard", str(tmp_path / "sweep"), "host=127.0.0.1", f"port={port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline, studies = time.monotonic() + 30, None
        while studies is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2) as response:
                    studies = json.loads(response.read())["study_summaries"]
            except OSError:
                time.sleep(0.2)
        assert studies is not None, "optuna-dashboard did not answer within 30 s"
        (summary,) = [s for s in studies if s["study_name"] == "d"]
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}?after=0", timeout=5
        ) as r:
            trials = json.loads(r.read())["trials"]
        assert [t["state"] for t in trials] == ["Complete", "Complete"]
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.slow
def test_submitit_jobs_report_to_the_study_from_their_own_processes(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        *FAST,
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra/launcher=submitit_local",
        MEDIAN,
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.output
    study = _study(str(sweep / "optuna.journal"), "expkit")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert all(len(t.intermediate_values) == 1 for t in study.trials)
    assert sorted(json.loads((sweep / j / "result.json").read_text())["optuna_trial"] for j in "01") == [0, 1]


def conditional_space(cfg, trial):
    """A custom_search_space: the momentum is searched only for SGD."""
    if trial.params["optim"] == "sgd":
        trial.suggest_float("optim.momentum", 0.5, 0.99)


def test_custom_search_space_adds_conditional_parameters_to_the_overrides():
    from hydra_plugins.expkit_sweeper.optuna_sweeper import OptunaSweeper

    sweeper = OptunaSweeper(custom_search_space=f"{__name__}.conditional_space")
    fixed, space = sweeper._space(["optim=choice(sgd,adam)", "optim.lr=tag(log, interval(0.001, 0.1))", "seed=3"])
    assert fixed == ["seed=3"] and set(space) == {"optim", "optim.lr"}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(8):
        trial = study.ask(fixed_distributions=space)
        overrides = sweeper._overrides(trial, space)
        names = {o.split("=")[0] for o in overrides}
        assert names == (
            {"optim", "optim.lr", "optim.momentum"} if trial.params["optim"] == "sgd" else {"optim", "optim.lr"}
        )
        seen.add(trial.params["optim"])
        study.tell(trial, 0.0)
    assert seen == {"sgd", "adam"}


@pytest.mark.slow
def test_seeds_per_trial_runs_each_trial_with_n_seeds_and_tells_their_mean(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*FAST, "hydra.sweeper.study_name=m", f"hydra.sweep.dir={sweep}", "hydra.sweeper.n_trials=2"]
    proc = run_cli(*args, "hydra.sweeper.seeds_per_trial=2")
    assert proc.returncode == 0, proc.output
    results = {j: json.loads((sweep / j / "result.json").read_text()) for j in "0123"}  # every seed's dir kept
    assert [results[j]["optuna_trial"] for j in "0123"] == [0, 0, 1, 1]
    study = _study(str(sweep / "optuna.journal"), "m")
    for trial, jobs in ((0, "01"), (1, "23")):
        values = [results[j]["best_metrics"]["val/acc"]["value"] for j in jobs]
        assert study.trials[trial].value == pytest.approx(sum(values) / 2)  # the mean, not one seed
        seeds = {json.loads((sweep / j / "job.json").read_text())["overrides"][-1] for j in jobs}
        assert seeds == {"trainer.seed=0", "trainer.seed=1"}
    groups = _rows(sweep)
    assert len(groups) == 2 and {g["n"] for g in groups} == {"2"}

    # every launch line shows the trial's own overrides alone: the override that tells the job its
    # trial goes to the job, not to the line (the study and storage were ~400 characters of
    # env_set on each: issue 53, item 4; the trial's: issue 64, item 11)
    launches = [line for line in proc.output.splitlines() if " : " in line and "#" in line]
    assert launches and all("EXPKIT_OPTUNA" not in line and "env_set" not in line for line in launches), launches
    assert all("trainer.seed=" in line for line in launches), launches

    # bad settings: one Error: line each, exit 2, nothing started (issue 53, item 14)
    for bad, named in (
        (["hydra.sweeper.seeds_per_trial=0"], "hydra.sweeper.seeds_per_trial=0"),
        (["hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0"),
        (["hydra.sweeper.seeds_per_trial=2", "seed_keys=[]"], "seed_keys=[] names none"),
    ):
        refused = run_cli(*args, *bad, f"hydra.sweep.dir={tmp_path / 'bad'}")
        assert refused.returncode == 2 and named in refused.stderr, refused.output
        errors = [line for line in refused.output.splitlines() if line.strip()]
        assert errors == [f"Error: {errors[0].removeprefix('Error: ')}"], refused.output  # the one line
        assert not (tmp_path / "bad" / "0").exists()


@pytest.mark.slow
def test_a_search_of_two_objectives_marks_exactly_the_studys_pareto_front(tmp_path):
    sweep = tmp_path / "sweep"
    objectives = ["hydra.sweeper.objectives=[val/acc,model_params]", "hydra.sweeper.study_name=mo"]
    refused = run_cli(*FAST, *objectives, f"hydra.sweep.dir={tmp_path / 'bad'}")
    assert refused.returncode == 2 and "model_params has no rule" in refused.stderr, refused.output
    assert "hydra.sweeper.directions=[maximize,<maximize|minimize>]" in refused.stderr
    pruned = run_cli(
        *FAST,
        *objectives,
        "hydra.sweeper.directions=[maximize,minimize]",
        "+hydra.sweeper.pruner._target_=optuna.pruners.MedianPruner",
        f"hydra.sweep.dir={tmp_path / 'p'}",
    )
    assert pruned.returncode == 2 and "cannot prune a study of several objectives" in pruned.stderr, pruned.output
    assert not (tmp_path / "bad" / "0").exists() and not (tmp_path / "p" / "0").exists()

    proc = run_cli(
        *FAST,
        *objectives,
        "hydra.sweeper.directions=[maximize,minimize]",
        "hydra.sweeper.n_trials=6",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.output[-3000:]
    study = _study(str(sweep / "optuna.journal"), "mo")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"] and len(study.trials) == 6
    best = json.loads((sweep / "best.json").read_text())
    front = {m["trial"] for m in best["pareto_front"]}
    assert front == {t.number for t in study.best_trials} and front  # exactly the non-dominated trials
    for member in best["pareto_front"]:
        told = study.trials[member["trial"]].values
        assert [member["values"]["val/acc"], member["values"]["model_params"]] == pytest.approx(told)
    rows = _rows(sweep)
    assert {r["job"] for r in rows if r["pareto"] == "True"} == {m["job"] for m in best["pareto_front"]}
    assert "Pareto front" in (sweep / "sweep.svg").read_text()
    colors = assert_svg_reads_right(sweep / "sweep.svg")  # the front's title fits, each job has its legend's color
    front = [c for c in ET.parse(sweep / "sweep.svg").getroot() if c.get("class") == "point" and c.get("data-key")]
    assert front and all(c.get("fill") == colors[c.get("data-key")] for c in front)


@pytest.mark.slow
def test_samplers_are_a_config_group_and_a_swapped_target_is_named(tmp_path):
    for sampler in ("random", "cmaes"):
        sweep = tmp_path / sampler
        proc = run_cli(
            *FAST, f"hydra/sweeper/sampler={sampler}", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep}"
        )
        assert proc.returncode == 0, proc.output[-3000:]
        name = {"random": "RandomSampler", "cmaes": "CmaEsSampler"}[sampler]
        assert f"sampler {name}" in proc.output
    # the docs said sampler takes "_target_ of any Optuna sampler": the TPE settings stayed and RandomSampler
    # raised a TypeError; now it names the group
    swapped = run_cli(
        *FAST, "hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler", f"hydra.sweep.dir={tmp_path / 's'}"
    )
    assert swapped.returncode == 2 and "hydra/sweeper/sampler=tpe|random|cmaes|qmc|grid|nsga2" in swapped.stderr
    assert "Traceback" not in swapped.output and not (tmp_path / "s" / "0").exists()
    grid = run_cli(
        *FAST,
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.params=null",
        "optim.lr=choice(0.1,0.05)",
        "hydra.sweeper.n_trials=5",
        f"hydra.sweep.dir={tmp_path / 'g'}",
    )
    assert grid.returncode == 0 and "the grid is gone through" in grid.output, grid.output[-3000:]
    assert sorted(p.name for p in (tmp_path / "g").iterdir() if p.name.isdigit()) == ["0", "1"]  # 2 points, not 5
