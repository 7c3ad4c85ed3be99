"""The Runner used from Python, without Hydra: ordering, dispatch, firing order, stop, errors, resume."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Recorder, toy_runner

from expkit import ConfigError, Hook, HookError, Priority, Runner, Stage
from expkit.engine.loops import TrainLoop
from expkit.hooks import CheckpointHook

GOLDEN = Path(__file__).parent / "golden" / "firing_order.txt"


def test_runner_without_hydra_trains_validates_tests_and_writes_result(tmp_path):
    runner = toy_runner(tmp_path, max_epochs=3)
    result = runner.run()
    assert result["status"] == "completed"
    assert set(result["final_metrics"]) == {"val/loss", "val/acc", "test/loss", "test/acc"}
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "completed"
    assert (tmp_path / "checkpoints" / "epoch_3.pth").is_file()
    assert runner.epoch == 3 and runner.iter == 6  # 8 samples, batch 4


def test_run_info_adds_to_result_json_but_never_replaces_the_runs_own_keys(tmp_path):
    runner = toy_runner(tmp_path, max_epochs=1)
    runner.run_info = {"status": "completed-ish", "epoch": 99, "traceback": "x", "note": "kept"}
    result = runner.run()
    stored = json.loads((tmp_path / "result.json").read_text())
    for record in (result, stored):
        assert (record["status"], record["epoch"], record["traceback"], record["note"]) == (
            "completed",
            1,
            None,
            "kept",
        )


def test_golden_firing_order_with_two_equal_priority_hooks(tmp_path):
    log: list[str] = []
    hooks = {"first": Recorder("A", log), "second": Recorder("B", log)}  # both NORMAL
    toy_runner(tmp_path, hooks=hooks, max_epochs=2).run()
    # A registered first, so at every stage A runs right before B
    assert log[0::2] == [e.replace("B.", "A.") for e in log[1::2]]
    assert all(e.startswith("A.") for e in log[0::2])
    transcript = "\n".join(e[2:] for e in log[0::2]) + "\n"
    if os.environ.get("EXPKIT_REGENERATE_GOLDEN") == "1":  # after an intended change of the order; review the diff
        GOLDEN.write_text(transcript)
    assert GOLDEN.is_file(), (
        f"{GOLDEN} is missing: regenerate it with EXPKIT_REGENERATE_GOLDEN=1 .venv/bin/python "
        "-m pytest tests/engine/test_runner.py -k golden, review it and commit it"
    )
    assert transcript == GOLDEN.read_text(), (
        "the firing order changed; if intended: EXPKIT_REGENERATE_GOLDEN=1 (see above)"
    )


def test_sorting_priorities_ties_and_defaults_first(tmp_path):
    log: list[str] = []
    hooks = [
        Recorder("low", log, priority="LOW"),
        Recorder("n1", log),  # NORMAL from the class
        Recorder("high", log, priority=Priority.HIGH),
        Recorder("n2", log, priority=50),
        Recorder("p55", log, priority=55),
    ]
    runner = toy_runner(tmp_path, hooks=hooks)
    names = runner.hook_names()
    # defaults register first: NORMAL customs run after timer and sampler_seed (both NORMAL)
    assert names == [
        "runtime_info",
        "RecordingHook_3",
        "timer",
        "sampler_seed",
        "RecordingHook_2",
        "RecordingHook_4",
        "RecordingHook_5",
        "logger",
        "param_scheduler",
        "RecordingHook",
        "checkpoint",
    ]
    runner.call_hook(Stage.BEFORE_RUN)
    assert log == [f"{n}.before_run" for n in ("high", "n1", "n2", "p55", "low")]


def test_register_hook_priority_argument_beats_class_attribute(tmp_path):
    log: list[str] = []
    runner = toy_runner(tmp_path, default_hooks={})
    runner.register_hook(Recorder("x", log), priority="LOWEST")
    runner.register_hook(Recorder("y", log, priority="HIGHEST"))
    runner.call_hook(Stage.BEFORE_RUN)
    assert log == ["y.before_run", "x.before_run"]


def test_bad_priority_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="SUPER"):
        toy_runner(tmp_path, hooks=[Recorder("x", [], priority="SUPER")])


def test_a_hook_runs_only_at_the_stages_it_overrides(tmp_path):
    class OnlyEpoch(Hook):
        def after_train_epoch(self, runner):
            pass

    runner = toy_runner(tmp_path, default_hooks={}, hooks=[OnlyEpoch()])
    runner.instrument(timing=True)  # hook_times: (stage, hook) -> [seconds, calls] for every call made
    runner.run()
    assert {key: calls for key, (_, calls) in runner.hook_times.items()} == {("after_train_epoch", "OnlyEpoch"): 2}
    table = runner.hook_order_table().splitlines()
    assert table[1:] == ["after_train_epoch:", "    (NORMAL      ) OnlyEpoch [OnlyEpoch]"]


def test_hook_order_table_lists_stages_with_priorities(tmp_path):
    table = toy_runner(tmp_path).hook_order_table()
    assert "after_train_iter:" in table
    section = table.split("after_train_iter:")[1].split(":\n")[0]
    assert section.index("IterTimerHook") < section.index("LoggerHook") < section.index("CheckpointHook")
    assert "(VERY_LOW    ) CheckpointHook [checkpoint]" in table
    assert "before_val_iter:" not in table  # no default hook uses it


def test_misspelt_stage_is_rejected_with_the_closest_name(tmp_path):
    class Typo(Hook):
        def after_train_itr(self, runner, **kwargs):
            pass

    with pytest.raises(HookError, match="did you mean after_train_iter"):
        toy_runner(tmp_path, hooks=[Typo()])


def test_wrong_signature_is_rejected_at_registration(tmp_path):
    class Wrong(Hook):
        def after_train_iter(self, runner, batch):  # payload is batch_idx, data_batch, outputs
            pass

    with pytest.raises(HookError, match=r"Wrong\.after_train_iter: wrong signature"):
        toy_runner(tmp_path, hooks=[Wrong()])


def test_a_raising_hook_names_itself_and_the_stage_and_the_run_is_failed(tmp_path):
    seen: list[str] = []

    class Boom(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if runner.iter == 2:
                raise RuntimeError("kaput")

        def on_exception(self, runner, *, exception):
            seen.append(type(exception).__name__)

        def after_run(self, runner):
            seen.append("after_run")

    with pytest.raises(HookError, match=r"in Boom\.after_train_iter: RuntimeError: kaput"):
        toy_runner(tmp_path, hooks=[Boom()]).run()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed"
    assert "Boom.after_train_iter" in result["error"] and "kaput" in result["error"]
    assert "Traceback" in result["traceback"]
    assert seen == ["HookError", "after_run"]
    # the last complete checkpoint (epoch 1) survives and is pointed at
    pointer = (tmp_path / "checkpoints" / "last_checkpoint").read_text()
    assert pointer.endswith("epoch_1.pth")


def test_request_stop_finishes_the_iteration_then_saves_last_and_still_tests(tmp_path):
    log: list[str] = []

    class Stopper(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if runner.iter == 2:  # third iteration, mid-epoch 2
                runner.request_stop("enough")

    runner = toy_runner(tmp_path, hooks=[Stopper(), Recorder("r", log)], max_epochs=5)
    result = runner.run()
    assert result["status"] == "stopped" and result["stop_reason"] == "enough"
    assert runner.iter == 3 and runner.epoch == 1
    assert log.count("r.after_train_iter") == 3
    assert "r.after_train" in log and "r.after_test" in log and log[-1] == "r.after_run"
    assert (tmp_path / "checkpoints" / "iter_3.pth").is_file()  # save_last on an early stop
    assert (tmp_path / "checkpoints" / "last_checkpoint").read_text().endswith("iter_3.pth")


def test_iteration_based_training_validates_every_interval(tmp_path):
    log: list[str] = []
    runner = toy_runner(tmp_path, hooks=[Recorder("r", log)], max_epochs=None, max_iters=5, val_interval=2)
    runner.run()
    assert runner.iter == 5
    assert log.count("r.before_val") == 3  # at 2, 4 and the last (5)
    assert log.count("r.before_train_epoch") == 3  # 2 batches per pass: passes of 2, 2, 1


def _weights(runner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in runner.model.parameters()]


@pytest.mark.parametrize("by_epoch", [True, False])
def test_resume_continues_exactly(tmp_path, by_epoch):
    budget = {"max_epochs": 4} if by_epoch else {"max_epochs": None, "max_iters": 7}
    ckpt = {"checkpoint": CheckpointHook(interval=1 if by_epoch else 3, by_epoch=by_epoch)}
    straight = toy_runner(tmp_path / "a", default_hooks=ckpt, **budget)
    straight.run()

    ckpt = {"checkpoint": CheckpointHook(interval=1 if by_epoch else 3, by_epoch=by_epoch)}
    short = {"max_epochs": 2} if by_epoch else {"max_epochs": None, "max_iters": 3}
    toy_runner(tmp_path / "b", default_hooks=ckpt, **short).run()
    ckpt = {"checkpoint": CheckpointHook(interval=1 if by_epoch else 3, by_epoch=by_epoch)}
    resumed = toy_runner(tmp_path / "b", default_hooks=ckpt, resume=True, seed=99, **budget)
    resumed.run()
    assert (resumed.epoch, resumed.iter) == (straight.epoch, straight.iter)
    for a, b in zip(_weights(straight), _weights(resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_run_state_is_one_object_that_a_checkpoint_saves_and_loads_whole(tmp_path):
    import dataclasses

    from expkit.engine.state import RunState

    runner = toy_runner(tmp_path / "a", max_epochs=2)
    runner.run()
    state = runner.state
    # every field of the run state is the Runner's attribute of the same name, read and set
    for f in dataclasses.fields(RunState):
        assert getattr(runner, f.name) is getattr(state, f.name), f.name
    runner.epoch = 41
    assert state.epoch == 41
    runner.epoch = 2
    assert not [k for k in vars(runner) if k in {f.name for f in dataclasses.fields(RunState)}]

    # the checkpoint's meta and RNG are the state's, and a fresh state loads them back whole
    checkpoint = torch.load(tmp_path / "a" / "checkpoints" / "epoch_2.pth", weights_only=True)
    saved = state.state_dict()
    clock = "wall_time_s"  # (the run's time so far: later now than at the save)
    assert {k: checkpoint["meta"][k] for k in saved["meta"] if k != clock} == {
        k: v for k, v in saved["meta"].items() if k != clock
    }
    assert 0 < checkpoint["meta"][clock] <= saved["meta"][clock]
    loaded = RunState()
    loaded.load_state_dict(checkpoint, tmp_path / "a" / "checkpoints" / "epoch_2.pth")
    assert loaded.earlier_wall_s == checkpoint["meta"][clock]
    assert (loaded.epoch, loaded.iter, loaded.inner_iter, loaded.position) == (2, 4, 0, state.position)
    assert loaded.best_metrics == state.best_metrics and loaded.val_metrics == state.val_metrics
    assert loaded.best_checkpoints == state.best_checkpoints  # (their names, read beside the file)
    assert loaded.last_checkpoint == tmp_path / "a" / "checkpoints" / "epoch_2.pth"

    # a best checkpoint whose recorded name leaves the checkpoint's dir is not taken
    checkpoint["meta"]["best_checkpoints"] = {"val/acc": "../../../etc/passwd"}
    outside = RunState()
    outside.load_state_dict(checkpoint, tmp_path / "a" / "checkpoints" / "epoch_2.pth")
    assert outside.best_checkpoints == {}


def test_load_from_loads_weights_only(tmp_path):
    first = toy_runner(tmp_path / "a", max_epochs=1)
    first.run()
    seen = {}

    class AtStart(Hook):
        def before_train(self, runner):  # after loading, before any step
            seen["position"] = (runner.epoch, runner.iter)
            seen["weights"] = [p.detach().clone() for p in runner.model.parameters()]

    toy_runner(tmp_path / "b", hooks=[AtStart()], max_epochs=1, load_from=tmp_path / "a/checkpoints/epoch_1.pth").run()
    assert seen["position"] == (0, 0)
    for a, b in zip(_weights(first), seen["weights"]):
        torch.testing.assert_close(a, b)


def test_missing_checkpoint_is_a_config_error(tmp_path):
    runner = toy_runner(tmp_path, resume=str(tmp_path / "nope.pth"))
    with pytest.raises(ConfigError, match="nope.pth: no such checkpoint"):
        runner.run()
    assert not (tmp_path / "result.json").exists()  # refused before anything was written


def test_model_with_its_own_train_step(tmp_path):
    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.calls = 0

        def forward(self, x):
            return self.lin(x)

        def train_step(self, batch: Any) -> dict[str, Any]:
            self.calls += 1
            x, y = batch
            logits = self(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, y) + 0.01 * logits.pow(2).mean()}

    runner = toy_runner(tmp_path, max_epochs=1, model=Custom())
    runner.run()
    assert runner.model.calls == 2


def test_stop_mid_epoch_then_resume_matches_an_uninterrupted_run(tmp_path):
    class StopAt3(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if runner.iter == 2:
                runner.request_stop("preempted")

    straight = toy_runner(tmp_path / "a", max_epochs=3)
    straight.run()
    toy_runner(tmp_path / "b", hooks=[StopAt3()], max_epochs=3).run()  # leaves iter_3.pth, mid-epoch 2
    resumed = toy_runner(tmp_path / "b", max_epochs=3, resume=True)
    assert resumed.run()["status"] == "completed"
    assert (resumed.epoch, resumed.iter) == (3, 6)
    for a, b in zip(_weights(straight), _weights(resumed)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_model_with_its_own_eval_step_feeds_the_metrics(tmp_path):
    class Flipped(torch.nn.Module):
        """Evaluates with swapped logits: accuracy must come from eval_step, not forward."""

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x)

        def eval_step(self, batch):
            x, y = batch
            logits = self(x)
            return {"loss": None, "logits": logits.flip(-1), "targets": y}

    model = Flipped()
    flipped = toy_runner(tmp_path / "a", max_epochs=1, model=model).validate()["val/acc"]
    plain = torch.nn.Sequential(model.lin)  # same weights, no eval_step: the default path
    normal = toy_runner(tmp_path / "b", max_epochs=1, model=plain).validate()["val/acc"]
    assert flipped == pytest.approx(1 - normal)  # two classes: swapped logits invert every prediction

    class FlippingRunner(Runner):  # a Runner subclass's eval_step is the one a pass calls
        def eval_step(self, data_batch):
            outputs = super().eval_step(data_batch)
            return {**outputs, "logits": outputs["logits"].flip(-1)}

    subclassed = toy_runner(tmp_path / "c", max_epochs=1, model=plain)
    subclassed.__class__ = FlippingRunner
    assert subclassed.validate()["val/acc"] == pytest.approx(1 - normal)

    class SwapIn(Hook):  # a hook that swaps the model in before the pass: its eval_step is the one
        def before_val(self, runner):
            runner.model = model

    swapped = toy_runner(tmp_path / "d", max_epochs=1, model=plain, hooks=[SwapIn()])
    assert swapped.validate()["val/acc"] == pytest.approx(flipped)


def test_interval_helpers_match_mmengine(tmp_path):
    seen: dict[str, list] = {"every_3": [], "inner_2": [], "end_of_epoch": [], "last": [], "epoch_2": []}

    class Intervals(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if self.every_n_train_iters(runner, 3):
                seen["every_3"].append(runner.iter)
            if self.every_n_inner_iters(batch_idx, 2):
                seen["inner_2"].append((runner.epoch, batch_idx))
            if self.end_of_epoch(runner, batch_idx):
                seen["end_of_epoch"].append(runner.iter)
            if self.is_last_train_iter(runner):
                seen["last"].append(runner.iter)
            assert not self.every_n_train_iters(runner, 0)  # n <= 0: never

        def after_train_epoch(self, runner):
            if self.every_n_epochs(runner, 2):
                seen["epoch_2"].append(runner.epoch)

    toy_runner(tmp_path, hooks=[Intervals()], max_epochs=4).run()  # 2 iterations per epoch, 8 in all
    assert seen == {
        "every_3": [2, 5],
        "inner_2": [(0, 1), (1, 1), (2, 1), (3, 1)],
        "end_of_epoch": [1, 3, 5, 7],
        "last": [7],
        "epoch_2": [1, 3],
    }


@pytest.mark.parametrize("raised", [RuntimeError("upload failed"), KeyboardInterrupt()])
def test_a_failure_in_after_run_fails_the_run_everywhere_it_is_reported(tmp_path, raised):
    class FailsAtTheEnd(Hook):
        def after_run(self, runner):
            raise raised

    runner = toy_runner(tmp_path, hooks=[FailsAtTheEnd()], max_epochs=1)
    with pytest.raises(type(raised) if isinstance(raised, KeyboardInterrupt) else HookError):
        runner.run()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and runner.status == "failed"
    assert runner.error == result["error"] and result["error"]


def test_failures_in_on_exception_and_after_run_after_the_run_failed_are_logged_and_the_first_error_stays(
    tmp_path, caplog
):
    class FailsTwice(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            raise RuntimeError("first")

        def on_exception(self, runner, *, exception):
            raise RuntimeError("second, in on_exception")

        def after_run(self, runner):
            raise RuntimeError("third, in after_run")

    runner = toy_runner(tmp_path, hooks=[FailsTwice()], max_epochs=1)
    with pytest.raises(HookError, match="first"):
        runner.run()
    assert "first" in json.loads((tmp_path / "result.json").read_text())["error"]
    assert (
        "Also, after the run had failed: in FailsTwice.on_exception: RuntimeError: second, in on_exception"
        in caplog.text
    )
    assert "Also, after the run had failed: in FailsTwice.after_run: RuntimeError: third, in after_run" in caplog.text


def test_the_plain_iteration_trains_exactly_as_the_general_one(tmp_path):
    """The common iteration (one optimizer, no clipping or scaler, not instrumented) is called
    in place; an instrumented run takes the general path (phases, Optimizers.step,
    call_hook). Both train the same weights and log the same losses."""
    finals, losses = [], []
    for instrumented in (False, True):
        work = tmp_path / str(instrumented)
        runner = toy_runner(work, max_epochs=3)
        if instrumented:
            runner.instrument(timing=True)
        runner.run()
        assert (TrainLoop(runner).plain_optimizer is None) == instrumented  # the path each run took
        if instrumented:  # (the general path: every phase timed)
            assert {"forward", "backward", "optimizer"} <= set(runner.phase_times)
        finals.append({k: v.clone() for k, v in runner.model.state_dict().items()})
        records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["train/loss"] for r in records if "train/loss" in r])
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert losses[0] == losses[1] and len(losses[0]) == 3  # (a record at the end of each epoch)


def test_a_runner_that_dispatches_hooks_its_own_way_gets_every_iteration_stage(tmp_path):
    """A subclass's call_hook, or a replacement, sees every stage the loop calls: after_train_iter
    at every iteration while a hook listens there every iteration, else at the logging steps only
    (the timer and the logger run there)."""
    seen: list[str] = []

    class Every(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            self.calls = getattr(self, "calls", 0) + 1

    class Tracing(Runner):
        def call_hook(self, stage, **payload):
            seen.append(str(stage))
            super().call_hook(stage, **payload)

    class Failing(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if runner.iter == 2:
                raise ValueError("third iteration")

    base = toy_runner(tmp_path / "a", max_epochs=1)
    traced = Tracing(
        model=base.model,
        optimizer=base.optimizer,
        train_loader=base.train_loader,
        work_dir=tmp_path / "b",
        settings=base.settings,
        hooks=[every := Every()],
    )
    traced.run()
    assert seen.count("after_train_iter") == traced.iter == every.calls == 2
    replaced = toy_runner(tmp_path / "c", max_epochs=1)
    calls: list[str] = []
    original = replaced.call_hook
    replaced.call_hook = lambda stage, **payload: (calls.append(str(stage)), original(stage, **payload))[1]
    replaced.run()
    assert calls.count("after_train_iter") == 1  # 2 iterations, the second a logging step (the epoch's last)
    with pytest.raises(HookError, match=r"in Failing.after_train_iter: ValueError: third iteration"):
        toy_runner(tmp_path / "d", hooks=[Failing()], max_epochs=2).run()


@pytest.mark.parametrize(
    "precision",
    [
        "32",
        "bf16",  # the evaluation's step in autocast
        pytest.param("16", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 needs a CUDA GPU")),
    ],
)
def test_a_finished_runner_is_freed_without_the_garbage_collector(tmp_path, precision):
    """Nothing of a run makes a reference cycle through the Runner: dropped, it goes at once, with its
    model, optimizer state and loader workers, not at the collector's next pass (a sweep's next job in
    the same process, on a GPU, would otherwise find the last one's memory still held)."""
    import gc
    import weakref

    from expkit.hooks import EMAHook

    device = "cuda" if precision == "16" else "cpu"
    runner = toy_runner(tmp_path, hooks={"ema": EMAHook()}, max_epochs=1, precision=precision, device=device)
    freed = weakref.ref(runner)
    gc.collect()
    gc.disable()  # for the whole run: a cycle made at any point (an evaluation's loop) stays uncollected
    try:
        runner.run()
        del runner
        assert freed() is None
    finally:
        gc.enable()
