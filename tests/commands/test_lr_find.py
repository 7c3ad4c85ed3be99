"""python -m expkit.lr_find: a real range test on the default experiment (its record, plot and
suggestion; param groups keep their ratio; no checkpoint), under torchrun (rank 0 writes), and
bad settings refused with one line."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import xml.etree.ElementTree as ET

import pytest
from conftest import assert_svg_reads_right, run_module, torchrun

from expkit.lr_find import suggest

SVG = "{http://www.w3.org/2000/svg}"


def lr_find(*args: str) -> subprocess.CompletedProcess:
    return run_module("expkit.lr_find", *args)


def _steepest(lrs: list[float], smoothed: list[float], skip: int) -> float:
    """The test's own reading of the rule: the most negative slope of the smoothed loss against
    log10(lr) (numpy.gradient's differences), without the first `skip` points and the last."""
    import numpy as np

    xs, ys = np.log10(lrs[skip:-1]), np.array(smoothed[skip:-1])
    return lrs[skip + int(np.argmin(np.gradient(ys, xs)))]


@pytest.mark.slow
def test_the_range_test_records_plots_and_suggests_without_a_checkpoint(tmp_path):
    run_dir = tmp_path / "lr"
    proc = lr_find(
        "lr_find.iters=40",
        "lr_find.min=1e-4",
        "lr_find.max=20",
        "lr_find.smoothing=0.8",
        "optim.param_groups=[{match: '*.bias', lr_mult: 10}]",
        "sched=cosine",  # (left out: the test sets the lr itself)
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.output
    record = json.loads((run_dir / "lr_find.json").read_text())
    lrs, losses, smoothed = record["lrs"], record["losses"], record["smoothed_losses"]
    # exponential from lr_find.min, at most lr_find.iters points, one loss and one smoothed loss each
    assert 10 <= len(lrs) == len(losses) == len(smoothed) <= 40
    assert lrs[0] == pytest.approx(1e-4)
    assert all(b / a == pytest.approx((20 / 1e-4) ** (1 / 39)) for a, b in itertools.pairwise(lrs))
    assert all(math.isfinite(v) for v in losses + smoothed)
    # SGD from lr 0.1 up to 20 on the digits MLP diverges: the test stopped there, past 4x the lowest
    assert len(lrs) < 40 and record["stopped"].startswith("the smoothed loss"), record["stopped"]
    assert smoothed[-1] > 4 * min(smoothed) >= 4 * min(smoothed[:-1])
    assert losses[0] == pytest.approx(math.log(10), abs=0.2)  # a fresh 10-class model
    # the suggestion: the steepest descent of the smoothed loss, where the loss falls
    assert record["suggestion"] == _steepest(lrs, smoothed, 40 // 10)
    at = lrs.index(record["suggestion"])
    assert smoothed[at + 1] < smoothed[at - 1]
    assert f"Suggested learning rate: {record['suggestion']:.3g} (optim.lr={record['suggestion']:.3g})" in proc.stdout
    assert f"Rule: {record['rule']}" in proc.stdout and "steepest descent of the smoothed loss" in record["rule"]
    # every param group scaled by the same factor: the bias group stays at 10x
    groups = record["param_groups"]
    assert [g["lr_ratio"] for g in groups] == [1.0, 10.0]
    assert [g["last_lr"] for g in groups] == pytest.approx([lrs[-1], 10 * lrs[-1]])
    # the plot: the smoothed loss on a log lr axis with the suggestion marked, and each iteration's loss
    assert_svg_reads_right(run_dir / "lr_find.svg")
    root = ET.parse(run_dir / "lr_find.svg").getroot()
    titles = [t.text for t in root.findall(f"{SVG}text")]
    assert "LR range test: smoothed loss" in titles and "loss of each iteration" in titles
    marked = [c.find(f"{SVG}title").text for c in root.findall(f"{SVG}circle") if c.get("class") == "point"]
    assert marked == [f"suggestion {record['suggestion']:.3g}"]
    # nothing kept but the record, the plot and Hydra's record of the config
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "lr_find.json", "lr_find.svg"]


@pytest.mark.slow
def test_under_torchrun_rank_0_writes_one_record(tmp_path):
    args = ["lr_find.iters=10", "lr_find.min=1e-3", "lr_find.max=1", f"hydra.run.dir={tmp_path / 'lr'}"]
    proc = torchrun(*args, cwd=tmp_path, module="expkit.lr_find")
    assert proc.returncode == 0, proc.output
    assert proc.output.count("Suggested learning rate") == 1
    record = json.loads((tmp_path / "lr" / "lr_find.json").read_text())
    assert len(record["lrs"]) == 10 and record["suggestion"] in record["lrs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr"]  # (no other rank's dir, no outputs/)


def test_bad_settings_exit_2_with_one_line(tmp_path):
    for args, named in (
        (["lr_find.max=1e-9"], "lr_find.max=1e-09: give a learning rate above lr_find.min"),
        (["lr_find.iters=2"], "lr_find.iters=2: give 5 iterations or more"),
        (["-m", "optim.lr=0.1,0.2"], "the range test is one run"),
    ):
        proc = lr_find(*args, f"hydra.run.dir={tmp_path / 'lr'}")
        assert proc.returncode == 2, proc.output
        assert proc.stderr.startswith(f"Error: {named}") and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "lr" / "lr_find.json").exists()


def test_the_suggestion_is_the_steepest_descent_of_the_smoothed_loss():
    lrs = [10 ** (-5 + i / 4) for i in range(25)]
    # flat, then falling fastest from 1.7 to 0.8 (around iteration 12), then diverging
    losses = [2.0] * 10 + [1.9, 1.7, 1.3, 0.8, 0.5, 0.35, 0.3] + [0.4, 0.9, 1.5, 2.5, 4, 8, 20, 30]
    chosen, rule = suggest(lrs, losses, skip_begin=2)
    assert chosen == _steepest(lrs, losses, 2) == lrs[12]
    assert "leaving out the first 2 and the last 1 of 25 points" in rule
    assert suggest(lrs[:5], losses[:5], skip_begin=2) == (None, suggest(lrs[:5], losses[:5], 2)[1])
    assert suggest(lrs[:5], losses[:5], skip_begin=2)[1].startswith("no suggestion: 5 points")
    rising, reason = suggest(lrs, sorted(losses), skip_begin=2)
    assert rising is None and reason.startswith("no suggestion: the smoothed loss never fell")


def test_flush_denormal_is_set_before_the_model_is_built(tmp_path):
    # (run_module adds the caller's environment: OpenMP's settings that limit the threads are set here)
    env = {"OMP_NUM_THREADS": "2", "OMP_THREAD_LIMIT": "2", "OMP_DYNAMIC": "false"}
    proc = run_module(
        "expkit.lr_find",
        f"hydra.run.dir={tmp_path}",
        "lr_find.iters=20",
        "trainer.flush_denormal=true",
        env=env,
    )
    assert proc.returncode == 0, proc.output
    assert "started before it" not in proc.output  # the data's and the model's first ops came after
    assert "intra-op threads started while it was on go on flushing" in proc.output  # (a thread flushes)
