"""The custom hook catalog: each hook's effect on a real (toy) run."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch
from conftest import run_cli, torchrun, toy_runner
from torch import nn

from expkit import ConfigError, Hook, HookError, default_hooks
from expkit.hooks import (
    ActivationStatsHook,
    CheckpointHook,
    CSVHook,
    DetectAnomalyHook,
    EarlyStoppingHook,
    EmptyCacheHook,
    GradNormHook,
    InvalidLossHook,
    LoggerHook,
    MemorySummaryHook,
    ModelComplexityHook,
    PerfStatsHook,
    ProfilerHook,
    StopAfterHook,
)
from expkit.hooks.model_complexity import model_complexity
from expkit.metrics import Accuracy


def _records(work_dir):
    return [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]


# -- profiler ---------------------------------------------------------------------------------------
def _trace_names(path) -> set[str]:
    trace = json.loads(path.read_text())
    return {e.get("name", "") for e in trace["traceEvents"]}


def test_profiler_writes_a_chrome_trace_with_operators_and_stage_markers(tmp_path):
    hook = ProfilerHook(wait=1, warmup=1, active=2, profile_val=True)
    runner = toy_runner(tmp_path, hooks={"profiler": hook}, max_epochs=3)
    runner.run()
    (trace,) = (tmp_path / "traces" / "train").glob("*.pt.trace.json")
    names = _trace_names(trace)
    assert "aten::addmm" in names or "aten::linear" in names  # the model's operators
    assert {"stage/after_train_iter", "phase/forward", "phase/backward", "phase/optimizer"} <= names
    assert "LoggerHook.after_train_iter" in names  # each hook call by name
    assert "aten::" in (tmp_path / "traces" / "train_summary.txt").read_text()
    (val_trace,) = (tmp_path / "traces" / "val").glob("*.pt.trace.json")
    assert "stage/after_val_iter" in _trace_names(val_trace)
    assert not runner.instrumented  # markers are off once the window is over


def test_profiler_stops_cleanly_when_the_run_ends_early(tmp_path):
    class StopEarly(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if runner.iter == 2:
                runner.request_stop("early")

    hook = ProfilerHook(wait=0, warmup=1, active=10)  # the window would end at iteration 11
    runner = toy_runner(tmp_path, hooks={"stop": StopEarly(), "profiler": hook}, max_epochs=5)
    assert runner.run()["status"] == "stopped"
    (trace,) = (tmp_path / "traces" / "train").glob("*.pt.trace.json")
    assert "phase/forward" in _trace_names(trace)
    assert not runner.instrumented


def test_profiler_on_a_cpu_run_prints_nothing_of_kinetos_own(tmp_path):
    """On a CUDA build of torch with no GPU, kineto printed "ERROR: ... gpuGetDeviceCount failed
    with code 35" and its USDT lines to stderr (issue 64, item 9): noise on a complete CPU trace."""
    if torch.cuda.is_available():
        pytest.skip("kineto's GPU messages are the run's business on a GPU")
    proc = run_cli(
        "hooks=[profiler]", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path}", env={"KINETO_LOG_LEVEL": ""}
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert list((tmp_path / "traces" / "train").glob("*.pt.trace.json"))
    assert "gpuGetDeviceCount" not in proc.output and "USDT:" not in proc.output, proc.stderr[-2000:]


# -- early stopping -----------------------------------------------------------------------------------
class Scripted(Hook):
    """Replaces val/acc with a scripted sequence, one value per validation."""

    priority = "HIGHEST"

    def __init__(self, values):
        self.values = list(values)

    def after_val_epoch(self, runner, *, metrics):
        metrics["val/acc"] = self.values[runner.epoch - 1]


@pytest.mark.parametrize(
    "kwargs, values, stop_epoch",
    [
        ({"patience": 2}, [0.5, 0.6, 0.6, 0.55, 0.9, 0.9], 4),  # no improvement at 3 and 4
        ({"patience": 2, "min_delta": 0.05}, [0.5, 0.52, 0.54, 0.6, 0.6, 0.6], 3),  # +0.02 is too small
        ({"patience": 3, "stopping_threshold": 0.8}, [0.5, 0.85, 0.9, 0.9, 0.9, 0.9], 2),
        ({"patience": 5}, [0.5, float("nan"), 0.9, 0.9, 0.9, 0.9], 2),  # check_finite
    ],
)
def test_early_stopping_stops_at_the_right_epoch(tmp_path, kwargs, values, stop_epoch):
    stopper = EarlyStoppingHook(monitor="val/acc", **kwargs)
    runner = toy_runner(tmp_path, hooks=[Scripted(values), stopper], max_epochs=6)
    result = runner.run()
    assert result["status"] == "stopped" and "early stopping" in result["stop_reason"]
    assert runner.epoch == stop_epoch
    assert (tmp_path / "checkpoints" / f"epoch_{stop_epoch}.pth").is_file()


def test_early_stopping_state_survives_resume(tmp_path):
    values = [0.5, 0.6, 0.6, 0.6, 0.6, 0.6]
    toy_runner(tmp_path, hooks=[Scripted(values), EarlyStoppingHook("val/acc", patience=3)], max_epochs=3).run()
    fresh = EarlyStoppingHook("val/acc", patience=3)
    runner = toy_runner(tmp_path, hooks=[Scripted(values), fresh], max_epochs=6, resume=True)
    runner.run()
    assert runner.epoch == 5  # waits at 3 (restored), 4, 5: stops after three without improvement
    assert fresh.best_score == 0.6


@pytest.mark.parametrize(
    ("kwargs", "patience_again", "epoch_after"),
    [
        ({"patience": 2}, 2, 4),  # stopped at 4 by patience: resume=true stops again (trained one more epoch)
        ({"patience": 3, "stopping_threshold": 0.8}, 3, 2),  # the threshold: stopped for good
        ({"patience": 2}, 4, 6),  # a larger patience than the count reached: it trains on
    ],
)
def test_an_early_stopped_run_resumed_stops_again_unless_patience_grew(tmp_path, kwargs, patience_again, epoch_after):
    values = [0.5, 0.85, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    first = toy_runner(tmp_path, hooks=[Scripted(values), EarlyStoppingHook("val/acc", **kwargs)], max_epochs=8)
    stopped_at = first.run() and first.epoch
    again = {**kwargs, "patience": patience_again}
    runner = toy_runner(
        tmp_path, hooks=[Scripted(values), EarlyStoppingHook("val/acc", **again)], max_epochs=8, resume=True
    )
    result = runner.run()
    assert runner.epoch == epoch_after and result["status"] == "stopped", (stopped_at, runner.epoch)
    if epoch_after == stopped_at:
        assert "resumed after it" in result["stop_reason"]


class Parts:
    """A metric of no known class that computes a dict: its keys are known only after a pass."""

    higher_is_better = True

    def reset(self) -> None:
        pass

    def update(self, preds, targets) -> None:
        pass

    def compute(self) -> dict[str, float]:
        return {"a": 1.0}


def test_early_stopping_missing_monitor(tmp_path, caplog):
    for strict in (True, False):  # a metric validation cannot report fails at start-up, strict or not
        with pytest.raises(ConfigError, match=r"monitor='val/f1' is not a metric that validation reports; .*val/acc"):
            toy_runner(tmp_path / str(strict), hooks=[EarlyStoppingHook("val/f1", strict=strict)]).run()
    # a key a dict-valued metric might report passes the start-up check; strict decides when it is missing
    metrics = {"acc": Accuracy(), "parts": Parts()}
    with pytest.raises(HookError, match="val/parts/b"):
        toy_runner(tmp_path / "s", metrics=metrics, hooks=[EarlyStoppingHook("val/parts/b", strict=True)]).run()
    result = toy_runner(tmp_path / "b", metrics=metrics, hooks=[EarlyStoppingHook("val/parts/b")]).run()
    assert result["status"] == "completed"
    assert (
        "early stopping monitors 'val/parts/b', not among ['val/acc', 'val/loss', 'val/parts/a']; skipped"
        in caplog.text
    )


# -- invalid loss ----------------------------------------------------------------------------------------
class NaNAt(nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.calls, self.at = 0, at

    def forward(self, x):
        return self.lin(x)

    def train_step(self, batch):
        self.calls += 1
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        return {"loss": loss * float("nan") if self.calls == self.at else loss}


def test_invalid_loss_stops_before_the_weights_change_and_keeps_the_good_checkpoint(tmp_path):
    runner = toy_runner(tmp_path, hooks=[InvalidLossHook()], max_epochs=4, model=NaNAt(at=5))
    with pytest.raises(HookError, match=r"training loss is nan at epoch 3, iteration 5.*last good checkpoint.*epoch_2"):
        runner.run()
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and "nan" in result["error"]
    assert (tmp_path / "checkpoints" / "last_checkpoint").read_text().endswith("epoch_2.pth")


# -- budgets, anomaly, cache ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, iters", [({"iters": 3}, 3), ({"epochs": 2}, 4), ({"minutes": 0}, 1)])
def test_stop_after(tmp_path, kwargs, iters):
    runner = toy_runner(tmp_path, hooks=[StopAfterHook(**kwargs)], max_epochs=10)
    result = runner.run()
    assert result["status"] == "stopped" and result["stop_reason"].startswith("stop_after")
    assert runner.iter == iters


def test_detect_anomaly_is_on_while_training_only(tmp_path):
    seen = []

    class Look(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            seen.append(torch.is_anomaly_enabled())

    toy_runner(tmp_path, hooks=[DetectAnomalyHook(), Look()], max_epochs=1).run()
    assert seen == [True, True] and not torch.is_anomaly_enabled()


def test_empty_cache_reaches_the_chosen_points(tmp_path):
    hook = EmptyCacheHook(before_epoch=True, after_epoch=True, after_iter=True)
    toy_runner(tmp_path, hooks=[hook], max_epochs=2).run()
    # train: 2 epochs x (before + after + 2 iters); val: 2 x (before + after + 1 iter); test: 1 x 3
    assert hook.calls == 2 * 4 + 2 * 3 + 3


# -- measurements ------------------------------------------------------------------------------------
def test_model_complexity_of_the_default_mlp():
    from expkit.models import MLP

    stats = model_complexity(MLP(1, 8, 10), torch.zeros(1, 1, 8, 8))
    assert stats["flops"] == 2 * (64 * 256 + 256 * 256 + 256 * 10)
    assert stats["params"] == 85002
    assert stats["activations"] == 64 + 4 * 256 + 10  # flatten, 2 x (linear + relu), classifier


def test_model_complexity_lands_in_result_json(tmp_path):
    result = toy_runner(tmp_path, hooks=[ModelComplexityHook()], max_epochs=1).run()
    assert result["model_complexity"]["input_shape"] == [4]
    assert result["model_complexity"]["flops"] == 2 * (4 * 8 + 8 * 2)


def test_memory_summary_in_records_and_by_layer(tmp_path):
    hooks = default_hooks(logger=LoggerHook(interval=1))
    runner = toy_runner(tmp_path, default_hooks=hooks, hooks=[MemorySummaryHook(interval=2, by_layer=True)])
    result = runner.run()
    with_memory = [r for r in _records(tmp_path) if "memory/rss_mb" in r]
    assert [r["iter"] for r in with_memory] == [2, 4]
    assert all(r["memory/rss_mb"] > 10 and r["memory/peak_rss_mb"] >= r["memory/rss_mb"] * 0.5 for r in with_memory)
    assert set(result["memory_by_layer_mb"]) == {"0", "1", "2"}  # Linear, ReLU, Linear
    assert result["memory"]["memory/peak_rss_mb"] > 0


def test_perf_stats_counts_every_phase_and_hook(tmp_path):
    runner = toy_runner(tmp_path, hooks=[PerfStatsHook()], max_epochs=2)
    result = runner.run()
    stats = result["perf_stats"]
    assert {k: v["calls"] for k, v in stats["phases"].items()} == {
        "data": 4,
        "forward": 4,
        "backward": 4,
        "optimizer": 4,
    }
    by_key = {(h["hook"], h["stage"]): h for h in stats["hooks"]}
    assert by_key[("logger", "after_train_iter")]["calls"] == 2  # the logging steps: each epoch's last iteration
    assert by_key[("checkpoint", "after_train_epoch")]["calls"] == 2
    assert stats["hooks"][0]["seconds"] >= stats["hooks"][-1]["seconds"]  # slowest first
    assert not runner.instrumented


def test_activation_stats_match_the_layer_output(tmp_path):
    hooks = default_hooks(logger=LoggerHook(interval=1))
    stats = ActivationStatsHook(layers=["1"], interval=2)  # the ReLU
    runner = toy_runner(tmp_path, default_hooks=hooks, hooks=[stats], max_epochs=1)
    runner.run()
    (record,) = [r for r in _records(tmp_path) if "activations/1/mean" in r]
    assert record["iter"] == 2 and record["activations/1/mean"] >= 0 and record["activations/1/std"] > 0
    with pytest.raises(HookError, match=r"layers \['nope'\] are not in the model"):
        toy_runner(tmp_path / "b", hooks=[ActivationStatsHook(layers=["nope"])]).run()


def test_grad_norm_equals_the_norm_clipping_would_see(tmp_path):
    seen = []

    class Reference(Hook):
        priority = "LOW"  # after GradNormHook (ABOVE_NORMAL)

        def after_backward(self, runner, *, batch_idx, data_batch, outputs):
            total = nn.utils.clip_grad_norm_(runner.model.parameters(), float("inf"))
            seen.append((float(total), runner.extra_scalars.get("train/grad_norm")))

    toy_runner(tmp_path, hooks=[GradNormHook(interval=1), Reference()], max_epochs=1).run()
    assert len(seen) == 2
    for reference, published in seen:
        assert published == pytest.approx(reference, rel=1e-6)


def test_csv_has_one_row_per_epoch_matching_the_metrics(tmp_path):
    toy_runner(tmp_path, hooks=[CSVHook()], max_epochs=3).run()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    val = [r for r in _records(tmp_path) if "val/acc" in r]
    assert [float(r["val/acc"]) for r in rows] == [v["val/acc"] for v in val]
    assert all(math.isfinite(float(r["train/loss"])) for r in rows)


@pytest.mark.slow
def test_sync_buffers_averages_over_two_real_processes(tmp_path):

    script = tmp_path / "sync.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "from expkit.hooks.sync_buffers import sync_buffers\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "bn = torch.nn.BatchNorm1d(3)\n"
        "bn.running_mean.fill_(float(rank))\n"
        "n = sync_buffers(bn)\n"
        "print(f'RESULT {rank} {n} {bn.running_mean.tolist()}')\n"
        "dist.destroy_process_group()\n"
    )
    proc = torchrun(str(script), cwd=tmp_path, module=None, timeout=120)
    results = sorted(re.findall(r"RESULT (\d) (\d) (\[[^\]]*\])", proc.stdout))
    assert [r[0] for r in results] == ["0", "1"], proc.stdout + proc.stderr
    for _, synced, mean in results:  # running_mean and running_var averaged; the int counter is not
        assert (synced, mean) == ("2", "[0.5, 0.5, 0.5]")


def test_checkpoint_hook_default_is_still_first_among_very_low(tmp_path):
    runner = toy_runner(tmp_path, hooks={"profiler": ProfilerHook()})
    names = runner.hook_names()
    assert names.index("checkpoint") < names.index("profiler")
    assert isinstance(runner.hooks[names.index("checkpoint")], CheckpointHook)
