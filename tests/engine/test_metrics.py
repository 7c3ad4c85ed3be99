"""Any metric (torchmetrics included), fed by name, reported as floats; one notion of "better"."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, sweep_train, toy_runner
from hydra import compose, initialize_config_dir

from expkit.config.build import build_metrics, build_runner
from expkit.config.cli import CONF_DIR
from expkit.core.errors import ConfigError
from expkit.core.hydra_compat import INIT_KWARGS
from expkit.metrics import Accuracy, Directions, MetricSlot, better

torchmetrics = pytest.importorskip("torchmetrics")

F1 = "+metrics.f1={_target_:torchmetrics.classification.MulticlassF1Score,num_classes:10}"


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), **INIT_KWARGS):
        return compose(config_name="train", overrides=list(overrides))


def _records(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


def test_a_torchmetrics_metric_is_logged_as_a_float_everywhere(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = build_runner(_compose(F1, "trainer.max_epochs=2", "logger=[tensorboard]"), tmp_path).run()
    values = [r["val/f1"] for r in _records(tmp_path) if "val/f1" in r]
    assert len(values) == 2 and all(type(v) is float and 0.5 < v <= 1 for v in values)
    assert type(result["final_metrics"]["test/f1"]) is float
    assert result["best_metrics"]["val/f1"]["rule"] == "greater"  # torchmetrics' higher_is_better
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("val/f1")] == pytest.approx(values)


class _Seen:
    """Records what update() was given."""

    def __init__(self, result=1.0):
        self.calls, self.result = [], result

    def reset(self):
        self.calls = []

    def update(self, *args, **kwargs):
        self.calls.append((args, kwargs))

    def compute(self):
        return self.result


def test_a_metric_reads_the_step_outputs_it_names():
    outputs = {"logits": torch.ones(2, 3), "targets": torch.zeros(2), "masks": torch.ones(2, 4)}
    default, seen_list, seen_map = _Seen(), _Seen(), _Seen()
    MetricSlot(default, "d").update(outputs)  # preds falls back to logits
    MetricSlot(seen_list, "l", inputs=["masks", "targets"]).update(outputs)
    MetricSlot(seen_map, "m", inputs={"preds": "logits", "target": "masks"}).update(outputs)
    assert default.calls[0][0][0] is outputs["logits"] and default.calls[0][0][1] is outputs["targets"]
    assert seen_list.calls[0][0][0] is outputs["masks"]
    assert seen_map.calls[0][1] == {"preds": outputs["logits"], "target": outputs["masks"]}
    with pytest.raises(
        ConfigError, match=r"metrics.x reads 'boxes' .* \['logits', 'masks', 'targets'\]; set metrics.x.inputs"
    ):
        MetricSlot(_Seen(), "x", inputs=["boxes"]).update(outputs)


def test_a_metric_resolves_its_inputs_again_when_the_outputs_change_or_a_pass_begins():
    seen = _Seen()
    slot = MetricSlot(seen, "d")
    logits, preds, targets = torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2)
    slot.update({"logits": logits, "targets": targets})  # preds falls back to logits
    slot.update({"preds": preds, "targets": targets})  # no logits any more: preds
    first_pass = [call[0][0] for call in seen.calls]
    slot.reset()
    slot.update({"preds": preds, "logits": logits, "targets": targets})  # a new pass: preds first again
    assert first_pass[0] is logits and first_pass[1] is preds and seen.calls[0][0][0] is preds


def test_results_become_floats_dicts_are_flattened_and_tensors_must_be_scalars():
    assert MetricSlot(_Seen(torch.tensor(0.25)), "a").compute() == {"": 0.25}
    nested = {"map": torch.tensor(0.5), "per": {"small": torch.tensor(0.1)}}
    assert MetricSlot(_Seen(nested), "det").compute() == {"/map": 0.5, "/per/small": pytest.approx(0.1)}
    with pytest.raises(ConfigError, match=r"metrics.v computed a tensor of shape \(3,\), not one number"):
        MetricSlot(_Seen(torch.ones(3)), "v").compute()
    with pytest.raises(ConfigError, match="metrics.s computed a str"):
        MetricSlot(_Seen("high"), "s").compute()
    with pytest.raises(ConfigError, match="has no update"):
        MetricSlot(object(), "o")


def test_a_metric_collection_reports_its_members_with_their_own_directions(tmp_path):
    from torchmetrics import MeanSquaredError, MetricCollection, R2Score

    slots = {"reg": MetricSlot(MetricCollection({"mse": MeanSquaredError(), "r2": R2Score()}), "reg")}
    directions = Directions(slots)
    assert directions.expected("val") == (["val/loss", "val/reg/mse", "val/reg/r2"], [])
    assert (directions.rule("val/reg/mse"), directions.rule("val/reg/r2")) == ("less", "greater")
    slots["reg"].update({"preds": torch.tensor([1.0, 2.0, 3.0]), "targets": torch.tensor([1.0, 2.0, 4.0])})
    assert slots["reg"].compute() == {"/mse": pytest.approx(1 / 3), "/r2": pytest.approx(1 - 9 / 42)}


def test_the_direction_comes_from_the_setting_then_the_object_then_the_name():
    from torchmetrics import MeanSquaredError

    slots = build_metrics(
        _compose(
            "+metrics.acc_gap={_target_:expkit.metrics.Accuracy,higher_is_better:false}",
            "+metrics.mse={_target_:torchmetrics.MeanSquaredError}",
            "+metrics.top_err={_target_:torchmetrics.MeanSquaredError,higher_is_better:true}",
        ).metrics
    )
    directions = Directions(slots)
    assert directions.rule("val/acc_gap") == "less"  # the setting beats the name (acc) and the object (Accuracy)
    assert directions.rule("val/mse") == "less" and MeanSquaredError.higher_is_better is False  # the object
    assert directions.rule("val/top_err") == "greater"
    assert directions.rule("val/acc") == "greater" and directions.rule("val/loss") == "less"
    directions.declare("val/mse", "less", "hooks.early_stopping.rule")  # agrees: fine
    with pytest.raises(ConfigError, match="rule=greater contradicts metrics.acc_gap.higher_is_better"):
        directions.declare("val/acc_gap", "greater", "default_hooks.checkpoint.rule")
    assert directions.rule("val/score") is None  # asked before a hook declares it (answers are kept) ...
    directions.declare("val/score", "greater", "hooks.early_stopping.rule")
    assert directions.rule("val/score") == "greater"  # ... and worked out again after
    assert better(0.2, 0.3, "less") and not better(float("nan"), 0.3, "less") and better(1.0, None, "greater")
    with pytest.raises(ConfigError, match="higher_is_better='yes'"):
        MetricSlot(Accuracy(), "a", higher_is_better="yes")


def test_an_unknown_monitor_fails_at_start_up_naming_what_validation_reports(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"monitor='val/nope' is not a metric that validation reports; it reports: "
        r"val/loss, val/acc",
    ):
        toy_runner(tmp_path, monitor="val/nope").run()
    assert not (tmp_path / "checkpoints").exists()


SCRIPTED = '''
import json, os

class Scripted:
    """Reports values[i] (+ offset) at the i-th validation; no name rule knows 'acc_gap' is less-is-better."""

    def __init__(self, values, offset=0.0):
        self.values, self.offset, self.calls = list(values), offset, 0

    def reset(self):
        pass

    def update(self, preds, targets):
        pass

    def compute(self):
        self.calls += 1
        return self.values[min(self.calls, len(self.values)) - 1] + self.offset  # one call per validation


class ReturnValues:
    """A Hydra callback: records each job's return value (what a sweeper is given)."""

    def on_job_end(self, config, job_return, **kwargs):
        with open(os.environ["RETURNS"], "a") as f:
            f.write(json.dumps({"job": str(job_return.hydra_cfg.hydra.job.num), "value": job_return.return_value}) + "\\n")
'''


@pytest.mark.slow
def test_a_direction_set_once_is_used_by_every_consumer(tmp_path):
    """acc_gap has 'acc' in its name (the name rules say greater) and is set less-is-better once."""
    (tmp_path / "scripted.py").write_text(SCRIPTED)
    returns = tmp_path / "returns.jsonl"
    values = "[0.5,0.3,0.4,0.6,0.7,0.8]"  # best (least) at the 2nd validation; then 2 without improvement
    proc = subprocess.run(
        sweep_train(
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            f"+metrics.acc_gap={{_target_:scripted.Scripted,values:{values},higher_is_better:false}}",
            "+metrics.acc_gap.offset=0.0,0.1",
            "monitor=val/acc_gap",
            "trainer.max_epochs=6",
            "trainer.test_with=last",
            "hooks=[early_stopping]",
            "hooks.early_stopping.patience=2",
            "sched=plateau",
            "default_hooks.param_scheduler.monitor=val/acc_gap",
            "+hydra.callbacks.returns._target_=scripted.ReturnValues",
        ),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "RETURNS": str(returns)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    for job, offset in (("0", 0.0), ("1", 0.1)):
        result = json.loads((sweep / job / "result.json").read_text())
        best = result["best_metrics"]["val/acc_gap"]
        assert (best["rule"], best["epoch"]) == ("less", 2) and best["value"] == pytest.approx(0.3 + offset)  # tracking
        assert result["monitor_rule"] == "less"
        assert Path(result["best_checkpoint"]).name == "best_val_acc_gap_epoch_2.pth"  # save_best
        assert result["status"] == "stopped" and result["epoch"] == 4  # early stopping counted 0.4, 0.6 as worse
        assert "ReduceLROnPlateau mode min for val/acc_gap" in (sweep / job / "train.log").read_text()  # plateau
    best = json.loads((sweep / "best.json").read_text())
    assert (best["job"], best["rule"], best["value"]) == ("0", "less", pytest.approx(0.3))  # summary, best.json
    summary = (sweep / "summary.csv").read_text().splitlines()
    assert summary[1].startswith("0,") and summary[2].startswith("1,")  # best (least) first
    returned = {r["job"]: r["value"] for r in map(json.loads, returns.read_text().splitlines())}
    assert returned == {"0": pytest.approx(0.3), "1": pytest.approx(0.4)}  # what the sweeper is given


@pytest.mark.slow
def test_a_sweep_summary_shows_a_torchmetrics_metric_as_a_float(tmp_path):
    proc = subprocess.run(
        sweep_train(f"hydra.sweep.dir={tmp_path}", F1, "monitor=val/f1", "trainer.max_epochs=1", "optim.lr=0.1,0.01"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = json.loads((tmp_path / "best.json").read_text())
    assert best["metric"] == "val/f1" and best["rule"] == "greater" and isinstance(best["value"], float)
    rows = (tmp_path / "summary.csv").read_text().splitlines()[1:]
    assert len(rows) == 2 and all(0 < float(row.split(",")[4]) <= 1 for row in rows)


def test_a_sweep_reads_the_monitored_metrics_direction_from_its_setting_whatever_the_key_form():
    from expkit.metrics import monitor_of

    metrics = {"score": {"_target_": "x.Score", "higher_is_better": False}, "f1": {"higher_is_better": True}}
    for monitor in ("val/score", "val/noisy/score"):  # one val set, a named one
        assert monitor_of({"monitor": monitor, "metrics": metrics}) == (monitor, "less")
    assert monitor_of({"monitor": "val/f1/cat", "metrics": metrics}) == ("val/f1/cat", "greater")  # a dict metric's key
    assert monitor_of({"monitor": "val/noisy/loss", "metrics": metrics}) == ("val/noisy/loss", "less")  # by name
    assert monitor_of(None) == ("val/acc", "greater")


class _ReadLog(torch.utils.data.Dataset):
    """Eight labelled samples; each read appends "<pid> <index>" to a file (workers included)."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {index}\n")
        return torch.full((4,), float(index)), index % 2


def test_the_metric_probe_reads_two_samples_here_and_starts_no_loader_worker(tmp_path):
    """The probe read the first validation batch through the loader: with persistent workers
    they started at start-up, read ahead a whole validation's batches, and the first real pass
    waited for all of them (issue 66). It reads the first two samples in this process now, and
    still refuses a metric that does not fit the data."""
    from torch.utils.data import DataLoader

    from expkit.metrics import probe_metrics

    log = tmp_path / "reads.txt"
    val = DataLoader(_ReadLog(log), batch_size=4, num_workers=1, persistent_workers=True)
    runner = toy_runner(tmp_path / "run", model=torch.nn.Linear(4, 2))
    runner.val_loader = val
    probe_metrics(runner)
    assert log.read_text().splitlines() == [f"{os.getpid()} 0", f"{os.getpid()} 1"]
    runner.metrics = {"acc": MetricSlot(Accuracy(top_k=5))}
    with pytest.raises(ConfigError, match="fails on the first validation batch"):
        probe_metrics(runner)
