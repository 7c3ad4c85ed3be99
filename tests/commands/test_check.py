"""python -m expkit.check: every shipped experiment passes; an experiment broken on purpose in
each of the usual ways (tests/commands/check_fixtures/checkfix.py) fails with exit 1 and a finding that
names the piece at fault; bad input exits 2. Real expkit.train processes, a real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, digit_shards_command, torchrun

from expkit.testing import assert_resumes_exactly

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "check_fixtures"
SHIPPED = sorted(p.stem for p in (REPO / "expkit" / "conf" / "experiment").glob("*.yaml"))


def check(
    *args: str, tmp_path: Path, cwd: Path | None = None, default_out: bool = False
) -> subprocess.CompletedProcess:
    """The check run in `cwd` (`tmp_path`), its scratch dir and report in `tmp_path` unless `args`
    give check.dir or check.out (or `default_out`: the report where the check puts it)."""
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "HYDRA_FULL_ERROR": "0"}
    given = {a.partition("=")[0].lstrip("+~") for a in args} | ({"check.out"} if default_out else set())
    chosen = [f"check.dir={tmp_path / 'scratch'}", f"check.out={tmp_path / 'check.json'}"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.check",
            "--config-dir",
            str(FIXTURES / "conf"),
            *args,
            *[c for c in chosen if c.partition("=")[0] not in given],
        ],
        cwd=cwd or tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    return proc


def test_the_default_experiment_is_reproducible_and_resumes_exactly(tmp_path):
    # in a git project, the report where it leaves the project's tree clean (its default place)
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("# the user's code\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(project)]
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    proc = check("check.keep=true", tmp_path=tmp_path, cwd=project, default_out=True)
    assert proc.returncode == 0, proc.output
    written = list((project / "outputs").rglob("*.json"))
    assert len(written) == 1 and f"Report: {written[0].relative_to(project)}" in proc.stdout, proc.stdout
    report = json.loads(written[0].read_text())
    assert report["ok"] is True and report["findings"] == []
    assert (report["budget"], report["kill_at"], report["steps_per_epoch"]) == (
        60,
        50,
        40,
    )  # 1.5 epochs, killed in the 2nd
    rows = {r["check"]: r for r in report["rows"]}
    assert rows["interrupted after a checkpoint"]["detail"].startswith("SIGKILL after iteration 50 (epoch 2, batch 10")
    for name in (
        "resume: same batches",
        "resume: final weights",
        "resume: final optimizer",
        "resume: final RNG streams",
        "resume: same hooks' state",
        "resume: same validation and test metrics",
        "resume: same metrics.jsonl",
        "resume: same result.json",
        "same seed: same batches",
        "same seed: same final state",
    ):
        assert rows[name]["result"] == "ok", rows[name]
    # check.keep=true: the three work dirs are there to look at, c resumed from its checkpoint at 50
    kept = Path(report["scratch"])
    assert kept.parent == tmp_path / "scratch" and str(kept) in proc.stdout
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["a", "b", "c"]
    resumed = json.loads((kept / "c" / "result.json").read_text())
    assert resumed["iter"] == 60 and (kept / "c" / "checkpoints" / "iter_50.pth").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "scratch"]  # nothing else where it ran
    # a later run's provenance does not count the report as a change to the code
    from expkit.workdir.provenance import _GitQuery

    assert _GitQuery(project).state(project / "outputs" / "runs" / "x")["changed_files"] == []


# the two slowest shipped experiments are checked on a budget inside their first epoch (the
# default crosses it: an epoch and a half, checked for the others and the default experiment)
BUDGETS = {"char_lm": 12, "segmentation": 12}
# the Hugging Face experiments on less text: a shorter epoch, still crossed (its end and validation)
SMALLER = {"hf_causal_lm": ["data.max_chars=60000"], "hf_text_classification": ["data.max_per_class=150"]}


def _shards(where: Path) -> list[str]:
    """experiment=digits_shards reads outputs/shards/digits: written here by its documented command
    (outside the scratch dir, which must end empty), and the experiment pointed at it."""
    digit_shards_command(where)
    return [
        f"data.train='{where}/train-{{000000..000004}}.tar'",
        f"data.val={where}/val-000000.tar",
        f"data.test={where}/test-000000.tar",
        f"data.index_dir={where}/index",
    ]


@pytest.mark.parametrize("experiment", SHIPPED)
def test_every_shipped_experiment_is_reproducible_and_resumes_exactly(tmp_path, experiment):
    overrides = [f"experiment={experiment}", *SMALLER.get(experiment, [])]
    if experiment == "digits_shards":  # (a streamed experiment, with 2 workers)
        overrides += _shards(tmp_path.parent / f"{tmp_path.name}-shards")
    report = assert_resumes_exactly(*overrides, iters=BUDGETS.get(experiment), scratch=tmp_path)
    assert report["ok"] and all(r["result"] in ("ok", "info") for r in report["rows"])
    assert list(tmp_path.iterdir()) == [], "the scratch dir is removed unless check.keep=true"


BROKEN = {
    "hidden hook state": (
        ["hooks=[hidden_ema]"],
        "hook `HiddenEMA` (hidden_ema) keeps state in `self.shadow` but has no state_dict()",
    ),
    "unseeded augmentation": (
        ["data=clock_seeded"],
        (
            "batch 0 of a second run from the same seed held the same samples with other values: the data "
            "pipeline of data=clock_seeded (`checkfix.ClockSeededAugmentation`, its train dataset "
            "`checkfix._Augmented`) draws randomness"
        ),
    ),
    "worker RNG": (
        ["data=worker_random"],
        "the DataLoader's 2 workers draw their random seeds from the global generator",
    ),
    "non-resumable sampler": (
        ["data=plain_shuffle"],
        "held other samples than without: the sampler `RandomSampler` has no state_dict()/set_epoch",
    ),
    "accumulating metric": (
        ["+metrics.my_acc._target_=checkfix.AccumulatingAccuracy"],
        "metric `my_acc` (AccumulatingAccuracy) gave another value after resume with the same weights",
    ),
    "non-deterministic op": (
        ["model=unpool"],
        "`torch.use_deterministic_algorithms` flagged `max_unpooling2d_forward_out` on cpu",
    ),
    "a weight changed after resume": (
        ["hooks=[perturb]"],
        (
            "iteration 50 after resume computed other losses or weights from the same "
            "batches (first differing weight: net.1.weight)"
        ),
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_experiment_broken_on_purpose_fails_and_the_finding_names_the_piece(tmp_path, case):
    args, finding = BROKEN[case]
    proc = check(*args, tmp_path=tmp_path)
    assert proc.returncode == 1, proc.output
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["ok"] is False
    messages = [f["message"] for f in report["findings"]]
    assert any(finding in m for m in messages), messages
    assert len(messages) == 1, f"one finding, the cause, not its consequences: {messages}"
    assert finding in proc.stdout and "Traceback" not in proc.output
    assert list((tmp_path / "scratch").iterdir()) == []


def test_the_pytest_helper_fails_with_the_findings(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)exited 1.*metric `my_acc` \(AccumulatingAccuracy\) gave another"):
        assert_resumes_exactly(
            "+metrics.my_acc._target_=checkfix.AccumulatingAccuracy",
            "data.batch_size=128",
            config_dir=FIXTURES / "conf",
            scratch=tmp_path,
            env={"PYTHONPATH": str(FIXTURES)},
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optim.lrr=0.1"], "optim.lrr"),
        (["-m", "optim.lr=0.1,0.2"], "-m: the check runs one experiment"),
        (["resume=true"], "resume=true: the check runs one experiment"),
        (["check.iters=1"], "check.iters=1: the check needs at least 2 iterations"),
        (["check.iters=10", "check.kill_at=10"], "check.kill_at=10: the interruption must fall inside the budget"),
        (["model=nope"], "model=nope"),
        (["trainer.seed=null"], "trainer.seed is null"),
        (["check.keep=maybe"], "check.keep=maybe: give check.keep=true or check.keep=false"),
        (["check.iters=many"], "check.iters=many: give a number of iterations"),
        (["+check.foo=1"], "check.foo: the check has no such setting; its settings: check.iters, check.kill_at"),
        (["check.dir=afile"], "check.dir=afile: {tmp_path}/afile is a file; give check.dir=<a directory"),
        (["check.out=afile/check.json"], "check.out=afile/check.json: {tmp_path}/afile is a file; give check.out="),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(tmp_path, args, message):
    (tmp_path / "afile").write_text("")
    proc = check(*args, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.output
    assert message.format(tmp_path=tmp_path) in proc.stderr and "Traceback" not in proc.output
    assert proc.stderr.count("Error:") <= 1, proc.stderr
    assert "Checking" not in proc.output, "found before any run was started"
    assert not (tmp_path / "check.json").exists()


def test_a_working_dir_it_cannot_write_in_exits_2_before_any_training(tmp_path):
    """Where the report goes by default (under the working dir) is tried first: a read-only
    working dir is named with what to type, before three runs train for nothing."""
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o555)
    # root writes anywhere: without CAP_DAC_OVERRIDE it keeps to the dir's mode as any user does
    as_user = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("setpriv (util-linux) is needed to drop root's override of file modes")
        as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    try:
        proc = subprocess.run(
            [*as_user, sys.executable, "-m", "expkit.check", f"check.dir={tmp_path / 'scratch'}"],
            cwd=project,
            env={**os.environ, "HYDRA_FULL_ERROR": "0"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        project.chmod(0o755)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert f"cannot write in {project}" in proc.stderr and "check.out=" in proc.stderr, proc.stderr
    assert proc.stderr.count("Error:") == 1 and "Traceback" not in output, output
    assert "Checking" not in output and not (tmp_path / "scratch").exists(), "found before any run was started"


# -- torchrun ... -m expkit.check: each run on as many processes, rank 0 killed ------------------------
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_under_torchrun_each_run_has_as_many_processes_and_resumes_exactly(tmp_path, strategy):
    proc = torchrun(
        f"trainer.strategy={strategy}",
        "check.keep=true",
        f"check.dir={tmp_path / 'scratch'}",
        f"check.out={tmp_path / 'check.json'}",
        cwd=tmp_path,
        module="expkit.check",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["ok"], report
    # 1,258 samples, 629 a rank, 32 a batch: 20 steps an epoch; an epoch and a half, killed at 25
    assert (report["steps_per_epoch"], report["budget"], report["kill_at"]) == (20, 30, 25)
    rows = {r["check"]: r for r in report["rows"]}
    assert rows["resume: same batches"]["detail"] == "iterations 25-29, 2 ranks"
    kept = Path(report["scratch"])
    for run in "abc":
        assert (kept / run / "check_probe.rank1.jsonl").exists()  # both ranks recorded what they saw
    suffix = ".dcp" if strategy == "fsdp" else ".pth"
    assert (kept / "c" / "checkpoints" / f"iter_25{suffix}").exists()
    for part in ("weights", "optimizer"):  # compared tensor by tensor, sharded or not
        row = rows[f"resume: final {part}"]
        assert row["result"] == "ok" and int(row["detail"].split()[0]) >= 6, (
            row
        )  # (the MLP: 6 weights; momentum for each)


def test_tensorboard_and_mlflow_are_read_back_and_compared_in_a_store_of_the_checks_own(tmp_path):
    """A metric never reset: its test value differs after resume in metrics.jsonl, and so in the
    TensorBoard event files and the MLflow store, both read back. Nothing lands where it ran."""
    proc = check(
        "+metrics.my_acc._target_=checkfix.AccumulatingAccuracy",
        "logger=[tensorboard,mlflow]",
        "data.batch_size=128",
        tmp_path=tmp_path,
    )
    assert proc.returncode == 1, proc.output
    rows = {r["check"]: r for r in json.loads((tmp_path / "check.json").read_text())["rows"]}
    for name in ("resume: same TensorBoard scalars", "resume: same MLflow metrics"):
        assert rows[name]["result"] == "differs" and "test/my_acc" in rows[name]["detail"], rows[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.json", "scratch"]  # no outputs/, no mlruns/


def test_ctrl_c_stops_the_runs_and_leaves_nothing(tmp_path):
    import signal
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expkit.check",
            f"check.dir={tmp_path / 'scratch'}",
            f"check.out={tmp_path / 'check.json'}",
        ],
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 120
    # its runs have started: a0.out is made as run a is launched and stays to the end (its dir a/ lives
    # only while it trains, a few seconds that a loaded machine's poll can miss)
    while not list((tmp_path / "scratch").glob("*/a0.out")) and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, "the check ended before its runs were seen"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Interrupted: the check stopped its runs" in err and "Traceback" not in err
    assert list((tmp_path / "scratch").iterdir()) == [] and not (tmp_path / "check.json").exists()
