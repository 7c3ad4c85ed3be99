"""Logging backends, read back from the real files: TensorBoard events, wandb offline runs,
the terminal (plain lines, or a progress line on a real pseudo-terminal)."""

from __future__ import annotations

import itertools
import json
import os
import pty
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import REPO, assert_svg_reads_right, run_cli, toy_runner

from expkit import default_hooks
from expkit.hooks import LoggerHook
from expkit.loggers.backends import Backend, TensorBoardBackend, WandbBackend
from expkit.loggers.wandb_files import offline_run_files, read_wandb_run, wait_for_wandb_run, wandb_run_complete


def _records(work_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runner = toy_runner(tmp_path, max_epochs=3)
    runner.loggers = {"tensorboard": TensorBoardBackend()}
    runner.config = {"model": {"_target_": "toy"}, "optim": {"lr": 0.1}}
    runner.run_info["overrides"] = ["optim.lr=0.1", "model=toy"]
    runner.run()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    records = _records(tmp_path)
    for key in ("train/loss", "train/lr", "val/acc", "val/loss", "test/acc"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(s, pytest.approx(v, rel=1e-6)) for s, v in _series(records, key)], key
    assert "config/text_summary" in events.Tags()["tensors"]
    assert "_hparams_/experiment" in events.PluginTagToContent("hparams")
    assert events.Scalars("best/val/acc")[0].value == pytest.approx(runner.best_metrics["val/acc"]["value"])


def _tensorboard_hparams(log_dir: Path) -> dict:
    """The hyperparameters of the run's HParams session, read back from its event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}


def test_tensorboard_hparams_hold_the_main_resolved_values_not_only_the_overrides(tmp_path):
    """Runs made apart compare in the HParams tab: a run with no overrides still records its
    optimizer, learning rate, batch size, model, epochs and seed; ``logger`` is no hyperparameter."""
    runner = toy_runner(tmp_path, max_epochs=1)
    runner.loggers = {"tensorboard": TensorBoardBackend()}
    runner.config = {
        "model": {"_target_": "expkit.models.MLP", "hidden": 64},
        "optim": {"_target_": "torch.optim.SGD", "lr": 0.05, "momentum": 0.9, "_partial_": True},
        "sched": None,
        "data": {"_target_": "expkit.data.DigitsData", "batch_size": 32},
        "trainer": {"max_epochs": 1, "max_iters": None, "seed": 7},
    }
    runner.run_info["overrides"] = ["logger=[tensorboard]", "trainer.seed=7", "hydra.run.dir=x"]
    runner.run()
    assert _tensorboard_hparams(tmp_path / "tb") == {
        "model": "MLP",
        "optim": "SGD",
        "optim.lr": 0.05,
        "optim.momentum": 0.9,
        "data": "DigitsData",
        "data.batch_size": 32,
        "trainer.max_epochs": 1,
        "trainer.seed": 7,
    }


def test_wandb_offline_run_holds_config_history_name_and_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: offline
    runner = toy_runner(tmp_path / "run", max_epochs=2)
    runner.loggers = {"wandb": WandbBackend(group="g1", tags=["t1"])}
    runner.config = {"optim": {"lr": 0.1}}
    runner.run_info["overrides"] = ["optim.lr=0.1"]
    runner.run()
    (path,) = offline_run_files(tmp_path / "run")
    run = read_wandb_run(path)
    assert run["run"]["name"] == "optim.lr=0.1" and run["run"]["group"] == "g1" and run["run"]["tags"] == ["t1"]
    assert run["config"]["optim"] == {"lr": 0.1}
    records = _records(tmp_path / "run")
    history = [(row["_step"], row["val/acc"]) for row in run["history"] if "val/acc" in row]
    assert history == [(s, pytest.approx(v)) for s, v in _series(records, "val/acc")]
    assert run["summary"]["status"] == "completed"
    assert run["summary"]["best/val/acc"] == pytest.approx(runner.best_metrics["val/acc"]["value"])


def test_a_wandb_log_counts_as_written_out_only_with_its_exit_record(tmp_path, monkeypatch):
    """wandb's service writes a run's log through a buffer and closes it after finish() has
    returned; the backend waits for the exit record, so a run's log is whole when run() ends.
    A log cut anywhere before the end of its exit record is read without error and is not
    complete."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    runner = toy_runner(tmp_path / "run", max_epochs=1)
    runner.loggers = {"wandb": WandbBackend()}
    runner.run()
    (path,) = offline_run_files(tmp_path / "run")
    data = path.read_bytes()
    assert wandb_run_complete(path) and read_wandb_run(path)["summary"]["status"] == "completed"
    cut = tmp_path / "cut.wandb"
    for end in (7, 8, 100, len(data) // 2, len(data) - 1):
        cut.write_bytes(data[:end])
        assert not wandb_run_complete(cut), end
        assert len(read_wandb_run(cut)["history"]) <= len(read_wandb_run(path)["history"])
    cut.write_bytes(data[:7])
    assert read_wandb_run(cut) == {"run": {}, "config": {}, "history": [], "summary": {}}
    assert wait_for_wandb_run(cut, timeout=0.05) is False
    with pytest.raises(ValueError, match="logger.wandb.flush_timeout"):
        WandbBackend(flush_timeout="soon")


class Broken(Backend):
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, record, step):
        self.calls += 1
        raise OSError(28, "No space left on device")


def test_a_failing_backend_warns_once_and_the_run_goes_on(tmp_path, caplog):
    broken = Broken()
    runner = toy_runner(tmp_path, max_epochs=2)
    runner.loggers = {"broken": broken}
    assert runner.run()["status"] == "completed"
    assert broken.calls == 1
    warnings = [r for r in caplog.records if "Logging backend broken failed" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert len([r for r in _records(tmp_path) if "val/acc" in r]) == 2
    assert (tmp_path / "checkpoints" / "epoch_2.pth").is_file()


def test_curves_svg_draws_every_metric_against_the_step(tmp_path):
    """One panel per metric (loss first), named on its y axis, with train/val lines and the test
    point in it and a legend naming each; every line placed by value on the run's step axis."""
    toy_runner(tmp_path, default_hooks=default_hooks(logger=LoggerHook(plot=True)), max_epochs=3).run()
    assert_svg_reads_right(tmp_path / "curves.svg")
    root = ET.parse(tmp_path / "curves.svg").getroot()  # well-formed XML, or this raises
    ns = {"s": "http://www.w3.org/2000/svg"}
    titles = [t.text for t in root.findall("s:text", ns) if t.get("font-size") == "13"]
    records = _records(tmp_path)
    keys = sorted({k for r in records for k in r if k.startswith(("train/loss", "val/", "test/"))})
    metrics = sorted({k.split("/", 1)[1] for k in keys}, key=lambda m: (m != "loss", m))
    assert titles == metrics and titles[0] == "loss"
    ylabels = [t.text for t in root.findall("s:text", ns) if (t.get("transform") or "").startswith("rotate(-90")]
    assert ylabels == metrics
    legend = {t.text for t in root.findall("s:text", ns) if t.get("font-size") == "10"}
    assert set(keys) <= legend
    lines = {line.find("s:title", ns).text: line for line in root.findall("s:polyline", ns)}
    assert set(lines) == {k for k in keys if not k.startswith("test/")}
    points = {c.find("s:title", ns).text for c in root.findall("s:circle", ns) if c.get("class") == "point"}
    assert points == {k for k in keys if k.startswith("test/")}  # one value: a point, not a line
    for key, line in lines.items():  # one vertex per record, placed by value: higher value, smaller y
        values = [r[key] for r in records if key in r]
        ys = [float(p.split(",")[1]) for p in line.get("points").split()]
        xs = [float(p.split(",")[0]) for p in line.get("points").split()]
        assert len(ys) == len(values)
        assert xs == sorted(xs)
        order_by_value = sorted(range(len(values)), key=lambda i: (values[i], -i))
        order_by_height = sorted(range(len(ys)), key=lambda i: (-ys[i], -i))
        assert [values[i] for i in order_by_value] == [values[i] for i in order_by_height]


def test_svg_ticks_cover_the_data_and_skip_non_finite_values(tmp_path):
    from expkit.loggers.svgplot import line_charts, nice_ticks

    for lo, hi in [(0.0123, 0.9876), (3, 3), (-5.5, 120.0), (1e-6, 3e-6), (800, 16000)]:
        ticks = nice_ticks(lo, hi)
        assert ticks[0] <= lo and ticks[-1] >= hi and 2 <= len(ticks) <= 8
        steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
        assert len(steps) == 1
    line_charts(tmp_path / "c.svg", {"train/loss": [(1, 2.0), (2, float("nan")), (3, 1.0)], "empty": []})
    root = ET.parse(tmp_path / "c.svg").getroot()
    (line,) = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(line.get("points").split()) == 2


def test_sweep_svg_log_axis_and_named_values(tmp_path):
    from expkit.sweeps.plots import plot_sweep

    def row(job, lr, model, best):
        return {
            "job": job,
            "monitor": "val/acc",
            "best": best,
            "overrides": f"optim.lr={lr} model={model}",
            "override_values": {"optim.lr": lr, "model": model},
            "curve": [(1, 0.3), (2, best)],
        }

    rows = [row("0", "0.001", "mlp", 0.5), row("1", "0.1", "cnn", 0.9), row("2", "0.01", "cnn", float("nan"))]
    plot_sweep(rows, tmp_path / "sweep.svg")
    root = ET.parse(tmp_path / "sweep.svg").getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"0.001", "0.01", "0.1"} <= set(texts)  # lr spans 100x: one tick per decade
    assert {"cnn", "mlp"} <= set(texts) and "model" in texts and "optim.lr" in texts
    points = [c for c in root.iter("{http://www.w3.org/2000/svg}circle") if c.get("class") == "point"]
    assert len(points) == 2 * 2  # two swept keys; job 2's NaN is left out
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 3


def test_optional_backends_are_not_imported_at_start_up():
    code = (
        "import sys, expkit.train, expkit.config.build, expkit.hooks; "
        "print([m for m in ('wandb', 'tensorboard', 'matplotlib', 'torch.utils.tensorboard') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_non_tty_prints_plain_lines_and_a_tty_gets_a_progress_line(tmp_path):
    plain = run_cli(f"hydra.run.dir={tmp_path / 'plain'}", "trainer.max_epochs=1")
    assert plain.returncode == 0
    assert "Epoch(train) [1/1][10/40]" in plain.output and "\x1b[K" not in plain.output

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "expkit.train", f"hydra.run.dir={tmp_path / 'tty'}", "trainer.max_epochs=1"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert "\r\x1b[Kepoch 1/1 [" in screen and "samples/s" in screen
    assert "Epoch(train)" not in screen  # the progress line replaces the periodic lines
    assert "Validation (epoch 1)" in screen  # tables still print
    assert "Epoch(train) [1/1][10/40]" in (tmp_path / "tty" / "train.log").read_text()  # the log file keeps them


@pytest.mark.slow
def test_two_jobs_of_a_sweep_are_two_wandb_runs_in_one_group(tmp_path):
    env = {"WANDB_SILENT": "true", "HOME": str(tmp_path)}
    proc = run_cli(
        "-m",
        "optim.lr=0.1,0.01",
        "trainer.max_epochs=1",
        "logger=[wandb,tensorboard]",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        env=env,
    )
    assert proc.returncode == 0, proc.output
    runs = [read_wandb_run(offline_run_files(tmp_path / "sweep" / str(job))[0]) for job in (0, 1)]
    assert runs[0]["run"]["id"] != runs[1]["run"]["id"]
    assert runs[0]["run"]["group"] == runs[1]["run"]["group"] == "sweep"
    assert [r["config"]["optim"]["lr"] for r in runs] == [0.1, 0.01]
    for job, run in enumerate(runs):
        jsonl = [
            json.loads(line) for line in (tmp_path / "sweep" / str(job) / "metrics.jsonl").read_text().splitlines()
        ]
        assert [row["val/acc"] for row in run["history"] if "val/acc" in row] == [
            r["val/acc"] for r in jsonl if "val/acc" in r
        ]
        assert (tmp_path / "sweep" / str(job) / "tb").is_dir()
