"""CheckpointHook parameter by parameter, resume exactness, corrupt and hostile files, signals."""

from __future__ import annotations

import array
import binascii
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import signal
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, Score, toy_runner

from expkit import ConfigError, Hook, HookError, default_hooks
from expkit.checkpoint.checkpoint_io import load_checkpoint
from expkit.core.rng import rng_states, set_rng_states
from expkit.hooks import CheckpointHook


def _names(work_dir: Path, pattern: str = "*.pth") -> list[str]:
    return sorted((p.name for p in (work_dir / "checkpoints").glob(pattern)), key=lambda n: (len(n), n))


def _ckpt(work_dir: Path, name: str) -> dict:
    return torch.load(work_dir / "checkpoints" / name, weights_only=True)


def _run(tmp_path, epochs=3, **hook_kwargs):
    runner = toy_runner(tmp_path, default_hooks={"checkpoint": CheckpointHook(**hook_kwargs)}, max_epochs=epochs)
    return runner, runner.run()


# -- parameters ------------------------------------------------------------------------------------
def test_save_optimizer_and_param_scheduler_false(tmp_path):
    runner = toy_runner(tmp_path, default_hooks={"checkpoint": CheckpointHook(save_optimizer=False)}, max_epochs=1)
    runner.scheduler = torch.optim.lr_scheduler.StepLR(runner.optimizer, 1)
    runner.run()
    assert "optimizer" not in _ckpt(tmp_path, "epoch_1.pth") and "scheduler" in _ckpt(tmp_path, "epoch_1.pth")
    runner = toy_runner(tmp_path / "b", default_hooks={"checkpoint": CheckpointHook(save_param_scheduler=False)})
    runner.scheduler = torch.optim.lr_scheduler.StepLR(runner.optimizer, 1)
    runner.run()
    checkpoint = _ckpt(tmp_path / "b", "epoch_2.pth")
    assert "optimizer" in checkpoint and "scheduler" not in checkpoint


def test_out_dir_gets_the_work_dir_name_and_the_pointer_stays_with_the_files(tmp_path):
    _run(tmp_path / "work", epochs=1, out_dir=str(tmp_path / "store"))
    target = tmp_path / "store" / "work"
    assert (target / "epoch_1.pth").is_file()
    assert (target / "last_checkpoint").read_text() == "epoch_1.pth"  # relative: the dir can move


def test_an_out_dir_url_gets_every_kept_checkpoint_and_the_pointer_after_the_local_files(tmp_path):
    import fsspec

    _run(tmp_path / "work", epochs=3, out_dir="memory://store/runs", save_best="val/acc")
    memory = fsspec.filesystem("memory")
    stored = sorted(p.rsplit("/", 1)[-1] for p in memory.ls("/store/runs/work", detail=False))
    local = sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert stored == local and "last_checkpoint" in stored and len([n for n in stored if n.startswith("epoch_")]) == 2
    assert memory.cat("/store/runs/work/last_checkpoint") == b"epoch_3.pth"
    assert (
        memory.cat("/store/runs/work/epoch_3.pth") == (tmp_path / "work" / "checkpoints" / "epoch_3.pth").read_bytes()
    )
    memory.rm("/store", recursive=True)


def test_filename_template(tmp_path):
    _run(tmp_path, epochs=2, filename_tmpl="ckpt_e{}.pth", save_best="val/acc")
    names = _names(tmp_path)
    assert "ckpt_e1.pth" in names and "ckpt_e2.pth" in names
    assert any(n.startswith("best_val_acc_ckpt_e") for n in names)


def test_max_keep_by_iteration(tmp_path):
    runner = toy_runner(
        tmp_path,
        default_hooks={"checkpoint": CheckpointHook(interval=1, by_epoch=False, max_keep_ckpts=2)},
        max_epochs=None,
        max_iters=5,
    )
    runner.run()
    assert _names(tmp_path) == ["iter_4.pth", "iter_5.pth"]


def test_save_best_list_auto_and_explicit_rule(tmp_path):
    _, result = _run(tmp_path / "a", epochs=4, interval=-1, save_last=False, save_best=["val/acc", "val/loss"])
    names = _names(tmp_path / "a")
    assert len([n for n in names if n.startswith("best_val_acc_")]) == 1
    assert len([n for n in names if n.startswith("best_val_loss_")]) == 1
    assert set(result["best_checkpoints"]) == {"val/acc", "val/loss"}

    _, result = _run(tmp_path / "b", epochs=4, interval=-1, save_last=False, save_best="auto")
    assert _names(tmp_path / "b")[0].startswith("best_val_loss_")  # the first metric validation reports

    losses: list[float] = []

    class Collect(Hook):
        def after_val_epoch(self, runner, *, metrics):
            losses.append(metrics["val/loss"])

    hook = CheckpointHook(interval=-1, save_last=False, save_best="val/loss", rule="greater")
    toy_runner(tmp_path / "c", default_hooks={"checkpoint": hook}, hooks=[Collect()], max_epochs=4).run()
    assert len(losses) == 4 and max(losses) != min(losses)
    assert hook.best_scores["val/loss"] == max(losses)  # rule=greater keeps the highest loss
    assert _names(tmp_path / "c") == [f"best_val_loss_epoch_{losses.index(max(losses)) + 1}.pth"]


def test_greater_and_less_keys_decide_the_rule(tmp_path):
    def run(name: str, **kwargs):
        hook = CheckpointHook(save_best="val/score", **kwargs)
        result = toy_runner(tmp_path / name, default_hooks={"checkpoint": hook}, metrics={"score": Score()}).run()
        return hook.rules, result["best_metrics"]["val/score"]["rule"]

    assert run("g", greater_keys=["score"]) == ({"val/score": "greater"}, "greater")  # the run tracks it the same way
    assert run("l", less_keys="score") == ({"val/score": "less"}, "less")
    with pytest.raises(ConfigError, match="cannot tell whether val/score is better .* metrics.score.higher_is_better"):
        run("none")
    with pytest.raises(ConfigError, match=r"save_best='val/nope' is not a metric that validation reports; .*val/score"):
        toy_runner(
            tmp_path / "typo",
            default_hooks={"checkpoint": CheckpointHook(save_best="val/nope")},
            metrics={"score": Score()},
        ).run()
    assert not (tmp_path / "typo" / "checkpoints").exists()  # refused at start-up, before training
    with pytest.raises(ValueError, match="rule must be"):
        CheckpointHook(save_best="val/acc", rule="bigger")
    with pytest.raises(ValueError, match="save_begin"):
        CheckpointHook(save_begin=-1)


def test_best_checkpoints_may_carry_the_optimizer(tmp_path):
    _, result = _run(tmp_path, epochs=2, save_best="val/acc", best_save_optimizer=True)
    assert "optimizer" in torch.load(result["best_checkpoint"], weights_only=True)


def test_published_keys_write_slim_hashed_copies(tmp_path):
    _run(tmp_path, epochs=2, save_best="val/acc", published_keys=["meta", "state_dict"])
    published = _names(tmp_path, "*-*.pth")
    assert len(published) == 2  # the last and the best
    for name in published:
        path = tmp_path / "checkpoints" / name
        data = path.read_bytes()
        assert name.endswith(f"-{hashlib.sha256(data).hexdigest()[:8]}.pth")
        slim = torch.load(io.BytesIO(data), weights_only=True)
        assert set(slim) == {"meta", "state_dict"}


# -- best state across resume (MMEngine #1166) ------------------------------------------------------
def test_resume_from_an_older_checkpoint_keeps_the_true_best_and_one_file(tmp_path):
    """Resuming from epoch_1.pth, whose hook state says best = 0.5 at epoch 1, while
    best_val_acc_epoch_3.pth (0.7) is on disk. Trusting the stale state would save 0.65 as
    a new best, leave two best files, and finally overwrite the 0.7 model with a worse one."""

    class ScriptedAcc(Hook):
        priority = "HIGHEST"

        def __init__(self, values):
            self.values = list(values)

        def after_val_epoch(self, runner, *, metrics):
            metrics["val/acc"] = self.values.pop(0)

    def runner(values, epochs, resume=False):
        hooks = {"checkpoint": CheckpointHook(save_best="val/acc", max_keep_ckpts=-1)}  # (epoch_1.pth stays)
        return toy_runner(tmp_path, default_hooks=hooks, hooks=[ScriptedAcc(values)], max_epochs=epochs, resume=resume)

    runner([0.5, 0.6, 0.7], 3).run()
    assert _names(tmp_path, "best_*") == ["best_val_acc_epoch_3.pth"]
    assert _ckpt(tmp_path, "epoch_1.pth")["hooks"]["checkpoint"]["best_scores"] == {"val/acc": 0.5}
    resumed = runner([0.65, 0.66, 0.68], 4, resume=str(tmp_path / "checkpoints" / "epoch_1.pth"))
    resumed.run()
    assert _names(tmp_path, "best_*") == ["best_val_acc_epoch_3.pth"]
    best = _ckpt(tmp_path, "best_val_acc_epoch_3.pth")["hooks"]["checkpoint"]["best_scores"]["val/acc"]
    assert best == 0.7


def test_regular_checkpoints_hold_the_state_of_the_validation_that_followed(tmp_path):
    hooks = {"checkpoint": CheckpointHook(save_best="val/acc")}
    result = toy_runner(tmp_path, default_hooks=hooks, max_epochs=3).run()
    state = _ckpt(tmp_path, "epoch_3.pth")["hooks"]["checkpoint"]
    assert state["best_paths"]["val/acc"] == Path(result["best_checkpoint"]).name  # not one validation behind


# -- files that must not be trusted -----------------------------------------------------------------
def test_truncated_checkpoint_is_named_and_auto_resume_falls_back(tmp_path, caplog):
    toy_runner(tmp_path, max_epochs=2).run()
    last = tmp_path / "checkpoints" / "epoch_2.pth"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"epoch_2.pth: unreadable or truncated"):
        load_checkpoint(last, "resume")
    resumed = toy_runner(tmp_path, max_epochs=3, resume=True)
    resumed.run()
    assert "falling back to an older one" in caplog.text and "epoch_2.pth" in caplog.text
    assert json.loads((tmp_path / "result.json").read_text())["epoch"] == 3


def test_a_resume_past_the_budget_says_it_trains_nothing_more(tmp_path, caplog):
    """resume=true trainer.max_epochs=2 on a run at epoch 3 completed silently at 3 (a trial user
    thought it had trained): it warns, with the setting to type. At the budget, nothing is said."""
    toy_runner(tmp_path, max_epochs=3).run()
    toy_runner(tmp_path, max_epochs=3, resume=True).run()  # (a finished run resumed: its budget)
    assert "past trainer" not in caplog.text
    toy_runner(tmp_path, max_epochs=2, resume=True).run()
    assert "The checkpoint is at epoch 3, past trainer.max_epochs=2: this run trains nothing more" in caplog.text
    assert "give trainer.max_epochs above 3" in caplog.text
    caplog.clear()
    toy_runner(tmp_path / "iters", max_iters=5, max_epochs=None).run()
    toy_runner(tmp_path / "iters", max_iters=4, max_epochs=None, resume=True).run()
    assert "at iteration 5, past trainer.max_iters=4" in caplog.text


class _Slow(Hook):
    def before_train(self, runner):
        import time

        time.sleep(0.3)


def test_a_resumed_runs_wall_time_counts_its_earlier_segments_up_to_the_checkpoint(tmp_path):
    first = toy_runner(tmp_path, hooks=[_Slow()], max_epochs=2).run()
    assert first["wall_time_s"] >= 0.3 and "segment_wall_time_s" not in first
    last = tmp_path / "checkpoints" / "epoch_2.pth"
    earlier = load_checkpoint(last, "resume")["meta"]["wall_time_s"]
    assert 0.3 <= earlier <= first["wall_time_s"]
    resumed = toy_runner(tmp_path, max_epochs=3, resume=True).run()
    segment = resumed["segment_wall_time_s"]
    assert 0 < segment < 0.3 and resumed["wall_time_s"] == pytest.approx(earlier + segment, abs=2e-3)
    # the third epoch's checkpoint counts on from the second's
    assert load_checkpoint(tmp_path / "checkpoints" / "epoch_3.pth", "resume")["meta"]["wall_time_s"] > earlier


@pytest.mark.parametrize("recorded", [float("nan"), float("inf"), -4.0, "12", True, None])
def test_a_checkpoints_unusable_wall_time_is_not_counted(tmp_path, recorded):
    toy_runner(tmp_path, max_epochs=1).run()
    path = tmp_path / "checkpoints" / "epoch_1.pth"
    checkpoint = load_checkpoint(path, "resume")
    checkpoint["meta"]["wall_time_s"] = recorded
    torch.save(checkpoint, path)
    resumed = toy_runner(tmp_path, max_epochs=2, resume=True).run()
    assert resumed["status"] == "completed" and "segment_wall_time_s" not in resumed
    assert 0 < resumed["wall_time_s"] < 5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (DCP in one process, as it says)
def test_a_sharded_checkpoint_with_a_truncated_or_missing_shard_is_named_and_resume_falls_back(tmp_path, caplog):
    """A node that died mid-write leaves a shard short: DCP found it only while loading, after the
    run had picked the checkpoint, and every restart picked it again. Now it is named before, and
    resume=true falls back to the older checkpoint. (The shards are DCP's own, written in one process.)"""
    import time

    import torch.distributed.checkpoint as torch_dcp

    from expkit.checkpoint import dcp
    from expkit.checkpoint.checkpoint_io import load_resumable

    for epoch in (1, 2):
        path = tmp_path / "checkpoints" / f"epoch_{epoch}.dcp"
        torch_dcp.save({"w": torch.arange(1000.0) * epoch}, checkpoint_id=str(path))
        torch.save({"meta": {"epoch": epoch}}, path / dcp.STATE_FILE)
        time.sleep(0.02)  # (newest first, by modification time)
    newest = tmp_path / "checkpoints" / "epoch_2.dcp"
    assert load_resumable(tmp_path)[0] == newest
    (shard,) = newest.glob("*.distcp")
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=rf"epoch_2.dcp: damaged sharded checkpoint: its shard {shard.name} holds"):
        load_checkpoint(newest, "resume")
    path, state = load_resumable(tmp_path)
    assert (path.name, state["meta"]["epoch"]) == ("epoch_1.dcp", 1)
    assert "falling back to an older one" in caplog.text and "a write cut short" in caplog.text
    shard.unlink()
    with pytest.raises(ConfigError, match=f"its shard {shard.name} is missing"):
        load_checkpoint(newest, "load_from", consolidate=False)


def test_resume_true_in_a_new_dir_trains_from_scratch_and_names_the_run_it_may_have_meant(tmp_path, caplog):
    """python -m expkit.train resume=true without hydra.run.dir makes a new timestamped dir: nothing in
    it to resume (a job script's resume=true on its first start), so it trains, and says which run
    beside it the user may have meant to continue, as the word to type."""
    earlier = tmp_path / "runs" / "2026-11-30_10-00-00"
    toy_runner(earlier, max_epochs=1).run()
    alone = tmp_path / "alone" / "run"
    toy_runner(alone, max_epochs=1, resume=True).run()  # (nothing beside it)
    assert "training from scratch" in caplog.text and "hydra.run.dir=" not in caplog.text
    caplog.clear()
    fresh = tmp_path / "runs" / "2026-11-30_11-00-00"
    toy_runner(fresh, max_epochs=1, resume=True).run()
    assert (
        f"training from scratch. To continue the newest run beside it instead, give its dir: hydra.run.dir={earlier} resume=true"
        in caplog.text
    )
    assert json.loads((fresh / "result.json").read_text())["status"] == "completed"
    # a job of a resumed sweep that never saved starts, as its siblings' dirs are other jobs, not its own
    caplog.clear()
    sweep = tmp_path / "sweep"
    toy_runner(sweep / "0", max_epochs=1).run()
    job = toy_runner(sweep / "1", max_epochs=1, resume=True)
    job.run_info["sweep_dir"] = str(sweep)
    with caplog.at_level(logging.INFO, logger="expkit"):
        job.run()
    assert "this job has no checkpoint" in caplog.text and "starting it" in caplog.text
    assert "training from scratch" not in caplog.text and "hydra.run.dir=" not in caplog.text


def test_resume_given_a_run_dir_says_how_to_continue_that_run(tmp_path):
    """resume=outputs/runs/Y (a run dir, as eval, predict and export accept) said 'no such checkpoint file'."""
    from expkit.checkpoint.checkpoint_io import load_checkpoint_file

    run = tmp_path / "run"
    toy_runner(run, max_epochs=1).run()
    with pytest.raises(ConfigError, match=rf"resume={run}: that is a run dir.*hydra.run.dir={run} resume=true"):
        load_checkpoint_file(run, "resume")
    with pytest.raises(ConfigError, match="no such checkpoint file"):  # (not a run dir: as before)
        load_checkpoint_file(tmp_path / "nothing", "resume")


def test_a_sweep_dir_given_as_a_checkpoint_names_its_first_job(tmp_path):
    """checkpoint=<a sweep dir> warned 'no best checkpoint; using its last one', then 'the run dir has no checkpoint'."""
    from expkit.config.restore import resolve_checkpoint

    sweep = tmp_path / "sweep"
    for job in ("10", "2"):
        toy_runner(sweep / job, max_epochs=1).run()
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint={sweep}: a sweep dir, not a run's: give one of its jobs' dirs \({sweep / '2'}\)$",
    ):
        resolve_checkpoint(sweep)
    (sweep / "best.json").write_text("{}")
    with pytest.raises(ConfigError, match="or the best one, which .*best.json names"):
        resolve_checkpoint(sweep, "last")
    assert resolve_checkpoint(sweep / "2", "last").parent == sweep / "2" / "checkpoints"  # (a job's dir: as before)


class _Planted:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_holding_a_pickled_object_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {}, "payload": _Planted(str(marker))}, path)
    with pytest.raises(ConfigError, match=r"evil.pth: refused, the file holds pickled Python objects") as refused:
        load_checkpoint(path, "load_from")
    assert "Unsupported global" in str(refused.value)  # (what torch refused, not its advice's last line)
    assert not marker.exists()
    runner = toy_runner(tmp_path / "run", resume=str(path))
    with pytest.raises(ConfigError, match="refused"):
        runner.run()
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "content", "kind"),
    [
        ("result.json", b'{"status": "completed"}\n', "text"),
        ("last_checkpoint", b"epoch_2.pth", "text"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_called_so_not_a_security_refusal(tmp_path, name, content, kind):
    """result.json given as checkpoint= was "refused ... would run arbitrary code. Re-save only its weights"."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(tmp_path / name, "checkpoint")
    assert f"{name}: not a checkpoint: torch.save writes a zip archive, and this file is {kind}." in str(refused.value)
    (tmp_path / "zeros.pth").write_bytes(bytes(4096))  # (after a power cut: a checkpoint cut short, not a stranger)
    with pytest.raises(ConfigError, match=r"zeros.pth: unreadable or truncated checkpoint"):
        load_checkpoint(tmp_path / "zeros.pth", "checkpoint")


def test_a_failed_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    class BlockSecondSave(Hook):
        priority = "HIGHEST"

        def after_train_epoch(self, runner):
            if runner.epoch == 1:  # the temporary file's name becomes a directory: the write fails
                (tmp_path / "checkpoints" / f".epoch_2.pth.tmp{os.getpid()}" / "x").mkdir(parents=True)

    runner = toy_runner(tmp_path, hooks=[BlockSecondSave()], max_epochs=3)
    with pytest.raises(
        HookError, match=r"could not write .*epoch_2.pth: .*epoch_1.pth \(and last_checkpoint\) is intact"
    ):
        runner.run()
    assert (tmp_path / "checkpoints" / "last_checkpoint").read_text().endswith("epoch_1.pth")
    assert load_checkpoint(tmp_path / "checkpoints" / "epoch_1.pth")["meta"]["epoch"] == 1
    assert not (tmp_path / "checkpoints" / "epoch_2.pth").exists()
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


def test_a_pointer_that_cannot_be_written_fails_the_run_naming_it_and_the_checkpoint_resumes(tmp_path):
    (tmp_path / "checkpoints" / "last_checkpoint" / "x").mkdir(parents=True)  # a directory in the pointer's place
    runner = toy_runner(tmp_path, max_epochs=2)
    with pytest.raises(
        HookError,
        match=r"could not point .*last_checkpoint at epoch_1.pth: (IsADirectory|Permission)"
        r"Error.*epoch_1.pth itself is complete \(the old last_checkpoint is still there: remove it, "
        r"and resume=true finds epoch_1.pth\)",
    ):
        runner.run()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and result["last_checkpoint"] == str(tmp_path / "checkpoints" / "epoch_1.pth")
    assert load_checkpoint(tmp_path / "checkpoints" / "epoch_1.pth")["meta"]["epoch"] == 1
    shutil.rmtree(tmp_path / "checkpoints" / "last_checkpoint")
    resumed = toy_runner(tmp_path, max_epochs=2, resume=True)
    resumed.run()
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "completed" and resumed.epoch == 2
    assert (tmp_path / "checkpoints" / "last_checkpoint").read_text() == "epoch_2.pth"


# -- RNG and signals ----------------------------------------------------------------------------------
def test_rng_states_round_trip_python_numpy_torch():
    state = rng_states()
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_states(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["numpy"]["pos"] == state["numpy"]["pos"]
    set_rng_states(loaded)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_rng_states_are_pickled_as_text_not_as_latin1_strings():
    # torch.save's pickle protocol 2 writes a bytes object as codecs.encode(<latin-1 str>), the str
    # re-encoded to UTF-8 byte by byte: three times the time of the text, at every checkpoint
    def pickled(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with zipfile.ZipFile(buffer) as archive:
            return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))

    assert b"_codecs" in pickled({"x": b"\xff" * 8})  # (what bytes would cost: the check can see it)
    states = rng_states()
    assert b"_codecs" not in pickled(states)
    leaves = [states["torch"], *states["python"].values(), *states["numpy"].values()]
    assert all(v is None or isinstance(v, (str, int, float)) for v in leaves), leaves  # (no tensor: a zip record each)


def test_a_cached_gaussian_put_back_with_the_same_words_is_saved_again():
    np.random.seed(5)
    np.random.randn()  # caches a gaussian: has_gauss=1
    cached = rng_states()
    assert cached["numpy"]["has_gauss"] == 1
    np.random.randn()  # uses it: the words stay, has_gauss=0
    assert rng_states()["numpy"]["has_gauss"] == 0
    set_rng_states(cached)  # the same words again, with the gaussian
    assert rng_states()["numpy"] == _numpy_state_by_its_getter() and np.random.get_state()[3] == 1
    np.random.seed(0)  # (no cached gaussian left for the next test)


def test_rng_states_saved_as_bytes_by_earlier_versions_still_restore():
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    earlier = {  # (rng_states of 2026-11, before the text)
        "python": {"version": version, "internal": array.array("Q", internal).tobytes(), "gauss": gauss},
        "numpy": {
            "keys": keys.astype(np.uint32).tobytes(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_states(earlier)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def _numpy_state_by_its_getter():
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "keys": binascii.b2a_base64(keys.astype(np.uint32).tobytes(), newline=False).decode("ascii"),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }


@pytest.mark.parametrize("before_numpy_1_25", [False, True])
def test_numpy_state_is_exact_after_every_kind_of_move(monkeypatch, before_numpy_1_25):
    # an unmoved generator is not read through NumPy's getter (28 us); every move is seen, also the
    # one that leaves the generator where it was: a second randn() uses the gaussian the first cached
    if before_numpy_1_25:  # (no get_bit_generator: every read is a full one)
        monkeypatch.delattr(np.random, "get_bit_generator", raising=False)
    reads = []
    getter = np.random.get_state
    monkeypatch.setattr(np.random, "get_state", lambda *a, **k: reads.append(1) or getter(*a, **k))
    saved = getter()
    moves = [
        ("nothing", lambda: None),
        ("rand", np.random.rand),
        ("nothing", lambda: None),
        ("randn, caching a gaussian", np.random.randn),
        ("nothing", lambda: None),
        ("randn, using the cached one", np.random.randn),
        ("nothing", lambda: None),
        ("seed", lambda: np.random.seed(3)),
        ("set_state", lambda: np.random.set_state(saved)),
        ("nothing", lambda: None),
    ]
    rng_states()
    before = "nothing"
    for name, move in moves:
        move()
        reads.clear()
        assert rng_states()["numpy"] == _numpy_state_by_its_getter(), name
        if name == "nothing" and before != "randn, caching a gaussian":
            # the reference's read only: the state has not moved since the last (NumPy before 1.25,
            # without get_bit_generator, reads it whole every time)
            assert reads == ([1] if hasattr(np.random, "get_bit_generator") else [1, 1]), name
        before = name


def test_rng_states_saved_as_tensors_by_earlier_versions_still_restore():
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    earlier = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_states(earlier)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_a_stop_before_a_resumed_run_steps_writes_no_copy_of_its_checkpoint(tmp_path):
    """A signal while a resume loads: the stop's save at the same position used to write the
    checkpoint the run had just loaded again (a whole model's state, inside Slurm's GraceTime)."""

    class StopAtOnce(Hook):
        priority = "HIGHEST"

        def before_train(self, runner):
            runner.request_stop("signal SIGTERM")

    toy_runner(tmp_path, max_epochs=2).run()
    saved = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").glob("*.pth")}
    result = toy_runner(tmp_path, max_epochs=3, resume=True, hooks=[StopAtOnce()]).run()
    assert result["status"] == "stopped" and result["epoch"] == 2, result
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").glob("*.pth")} == saved


def test_sigterm_saves_stops_and_resumes_exactly(tmp_path):
    class Preempt(Hook):
        def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
            if runner.iter == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    straight = toy_runner(tmp_path / "a", max_epochs=3)
    straight.run()
    handler_before = signal.getsignal(signal.SIGTERM)
    stopped = toy_runner(tmp_path / "b", hooks=[Preempt()], max_epochs=3)
    result = stopped.run()
    assert signal.getsignal(signal.SIGTERM) is handler_before  # restored
    assert (result["status"], result["stop_reason"], stopped.stop_signal) == ("stopped", "signal SIGTERM", 15)
    assert "test/acc" not in result["final_metrics"]  # preempted: the test waits for the resumed run
    assert _names(tmp_path / "b", "iter_*") == ["iter_3.pth"]
    resumed = toy_runner(tmp_path / "b", max_epochs=3, resume=True)
    assert resumed.run()["status"] == "completed"
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_default_hooks_helper_replaces_and_drops():
    hooks = default_hooks(logger=None, checkpoint=CheckpointHook(interval=3))
    assert "logger" not in hooks and hooks["checkpoint"].interval == 3 and len(hooks) == 5


def test_iteration_based_training_names_its_best_by_iteration_with_the_default_hook(tmp_path):
    """The default hook counts epochs, but iteration-based training validates inside them: its best
    was named best_val_acc_epoch_0.pth, one name for every validation of the first epoch. It is
    named by the iteration validated, and a resume finds and ranks it."""
    hooks = {"checkpoint": CheckpointHook(save_best="val/acc")}  # (by_epoch=True, as the YAML's default)
    runner = toy_runner(tmp_path, default_hooks=hooks, max_epochs=None, max_iters=8, val_interval=2)
    best = Path(runner.run()["best_checkpoint"]).name
    assert re.fullmatch(r"best_val_acc_iter_[2468]\.pth", best), best
    assert _names(tmp_path, "best_*") == [best]
    hooks = {"checkpoint": CheckpointHook(save_best="val/acc")}
    resumed = toy_runner(
        tmp_path, default_hooks=hooks, max_epochs=None, max_iters=12, val_interval=2, resume=True
    ).run()
    (kept,) = _names(tmp_path, "best_*")
    assert (
        re.fullmatch(r"best_val_acc_iter_([2468]|10|12)\.pth", kept) and Path(resumed["best_checkpoint"]).name == kept
    )


def test_iteration_based_save_begin_and_best_names(tmp_path):
    hook = CheckpointHook(interval=2, by_epoch=False, save_begin=3, save_best="val/acc", max_keep_ckpts=-1)
    runner = toy_runner(tmp_path, default_hooks={"checkpoint": hook}, max_epochs=None, max_iters=8, val_interval=4)
    result = runner.run()
    regular = [n for n in _names(tmp_path) if n.startswith("iter_")]
    assert regular == ["iter_3.pth", "iter_5.pth", "iter_7.pth", "iter_8.pth"]
    best = Path(result["best_checkpoint"]).name
    assert best in ("best_val_acc_iter_4.pth", "best_val_acc_iter_8.pth")
    assert _names(tmp_path, "best_*") == [best]


def test_timer_state_travels_with_the_checkpoint(tmp_path):
    toy_runner(tmp_path, max_epochs=1).run()
    state = _ckpt(tmp_path, "epoch_1.pth")["hooks"]["timer"]
    assert state["avg_time"] > 0 and state["avg_data"] >= 0


def test_an_empty_pointer_falls_back_to_the_newest_loadable_checkpoint(tmp_path):
    toy_runner(tmp_path, max_epochs=2).run()
    (tmp_path / "checkpoints" / "last_checkpoint").write_text("")  # a kill while it was rewritten
    resumed = toy_runner(tmp_path, max_epochs=3, resume=True)
    resumed.run()
    assert resumed.iter == 6 and json.loads((tmp_path / "result.json").read_text())["epoch"] == 3


def test_without_its_pointer_a_run_dir_still_gives_its_newest_checkpoint(tmp_path):
    """The pointer is replaced by removing the old one first (see point_last_checkpoint): a
    reader in between, or after a kill there, gets the newest checkpoint file instead."""
    from expkit.checkpoint.checkpoint_io import find_last_checkpoint, load_resumable
    from expkit.eval import resolve_checkpoint

    toy_runner(tmp_path, max_epochs=3).run()
    pointer = tmp_path / "checkpoints" / "last_checkpoint"
    assert find_last_checkpoint(tmp_path).name == "epoch_3.pth"
    pointer.unlink()
    assert find_last_checkpoint(tmp_path).name == "epoch_3.pth"
    assert resolve_checkpoint(tmp_path, "last").name == "epoch_3.pth"
    assert load_resumable(tmp_path)[0].name == "epoch_3.pth"
    pointer.write_text("epoch_9.pth")  # names a file that is gone
    assert find_last_checkpoint(tmp_path).name == "epoch_3.pth"
    for path in (tmp_path / "checkpoints").glob("epoch_*.pth"):
        path.unlink()
    assert find_last_checkpoint(tmp_path) is None


FIXTURE = REPO / "tests" / "fixtures" / "iter_50-2026-11-27.pth"  # (tests/fixtures/README.md)


@pytest.mark.slow
def test_a_checkpoint_from_an_earlier_expkit_resumes_bit_identically(tmp_path):
    from conftest import run_cli

    stored = torch.load(FIXTURE, weights_only=True)  # tensors and plain containers, nothing to execute
    assert (stored["meta"]["epoch"], stored["meta"]["iter"]) == (1, 50) and "ema" in json.dumps(list(stored["hooks"]))
    args = [
        "model.hidden=[16]",
        "hooks=[ema]",
        "trainer.max_epochs=2",
        "default_hooks.checkpoint.by_epoch=false",
        "default_hooks.checkpoint.interval=50",
    ]
    shutil.copy(FIXTURE, tmp_path / "iter_50.pth")
    resumed = run_cli(*args, f"resume={tmp_path / 'iter_50.pth'}", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "iter_50.pth" in (tmp_path / "resumed" / "train.log").read_text()
    assert not (tmp_path / "resumed" / "checkpoints" / "iter_50.pth").exists()  # it trained iterations 51-80 only
    straight = run_cli(*args, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.output[-3000:]
    # the oracle is a straight run of iterations 1-80 on this machine; bit for bit only where this CPU
    # computes the fixture's first 50 iterations bit for bit (another CPU's kernels may sum in another
    # order: then every state must still agree to float tolerance, which a dropped state would not)
    here = _ckpt(tmp_path / "straight", "iter_50.pth")["state_dict"]
    same_cpu = all(torch.equal(here[k], stored["state_dict"][k]) for k in stored["state_dict"])
    ends = [_ckpt(tmp_path / run, "iter_80.pth") for run in ("resumed", "straight")]
    for part in ("state_dict", "optimizer", "ema_state_dict", "rng"):  # weights, momentum, EMA weights, RNG streams
        a, b = (torch.utils._pytree.tree_leaves(end[part]) for end in ends)

        def agree(x: object, y: object, exact: bool = same_cpu or part == "rng") -> bool:
            if not isinstance(x, torch.Tensor):
                return x == y
            if exact or not x.is_floating_point():
                return torch.equal(x, y)
            return torch.allclose(x, y, rtol=1e-4, atol=1e-5)

        assert len(a) == len(b) > 0 and all(agree(x, y) for x, y in zip(a, b, strict=True)), (part, same_cpu)
    assert ends[0]["hooks"]["ema"] == ends[1]["hooks"]["ema"] == {"steps": 80}
    results = [json.loads((tmp_path / run / "result.json").read_text()) for run in ("resumed", "straight")]
    assert "test/acc" in results[0]["final_metrics"]
    for key, value in results[0]["final_metrics"].items():
        other = results[1]["final_metrics"][key]
        assert value == other if same_cpu else value == pytest.approx(other, rel=1e-3, abs=1e-3), key
