"""The end of a torchrun run (2 CPU processes, gloo) that a stop cut short: every rank ends it the
same way, and no rank leaves while rank 0 still saves, records or requeues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import torchrun

pytestmark = pytest.mark.slow

ENDS = '''
import atexit, os, signal, time
import torch.distributed as dist
from expkit import Hook
from expkit.hooks.time_limit import TimeLimitHook

RANK = os.environ["RANK"]


@atexit.register
def stamp_exit():
    with open(f"exit_rank{RANK}.txt", "w") as f:
        f.write(repr(time.time()))


class RankZeroLimit(TimeLimitHook):
    """trainer.save_before_limit's guard as the Runner adds it under Slurm: on rank 0 only. The job's
    end comes at iteration 10, so the guard stops the run there, resumable."""

    def __init__(self):
        super().__init__(time.time() + 3600, margin_s=0.0, what="the test's limit")

    def after_train_iter(self, runner, **payload):
        if dist.get_rank() != 0:
            return
        if runner.iter == 10:
            self.deadline = time.monotonic()
        super().after_train_iter(runner, **payload)

    def after_run(self, runner):  # what each rank did after the stop
        with open(f"tested_rank{RANK}.txt", "w") as f:
            f.write(repr(sorted(runner.test_metrics or {})))


class SlowLastSave(Hook):
    """SIGTERM to rank 1 alone at iteration 15; rank 0's save at the stop takes 3 s more."""

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        if dist.get_rank() == 1 and runner.iter == 15 and not (runner.work_dir / "termed").exists():
            (runner.work_dir / "termed").touch()
            os.kill(os.getpid(), signal.SIGTERM)

    def after_save_checkpoint(self, runner, *, path, is_best, metric):
        if dist.get_rank() == 0 and runner.stop_reason is not None:
            time.sleep(3)
            with open("saved_rank0.txt", "w") as f:
                f.write(repr(time.time()))
'''


def _run(tmp_path: Path, *args: str) -> tuple[object, Path]:
    (tmp_path / "ends.py").write_text(ENDS)
    work = tmp_path / "run"
    proc = torchrun(
        f"hydra.run.dir={work}", "trainer.max_epochs=2", *args, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}
    )
    return proc, work


def test_rank_0s_time_limit_stop_is_resumable_on_every_rank_and_no_rank_tests(tmp_path):
    """The guard exists on rank 0 alone. Rank 1 used to take its stop for a plain one and run the
    test pass (whose weights' barrier and all-reduce rank 0 never joins), then fail or hang."""
    args = ("+hooks.limit._target_=ends.RankZeroLimit",)
    proc, work = _run(tmp_path, *args)
    assert proc.returncode != 0, proc.output[-3000:]  # (rank 0 exits 3: stopped ahead of the limit)
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "stopped" and result["stop_reason"].startswith("interrupted: "), result
    # (the guard fires in the iteration whose runner.iter is 10: the 11th)
    assert result["iter"] == 11 and (work / "checkpoints" / "iter_11.pth").is_file()
    assert [(tmp_path / f"tested_rank{r}.txt").read_text() for r in (0, 1)] == ["[]", "[]"]
    rank1 = (work / "rank1.log").read_text()
    assert "Stop requested: interrupted on another rank" in rank1 and "Test" not in rank1, rank1
    assert "stopped answering" not in proc.output, proc.output[-3000:]  # (rank 1, left alone in the test's barrier)

    resumed, _ = _run(tmp_path, "resume=true")
    assert resumed.returncode == 0, resumed.output[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert result["status"] == "completed" and "test/acc" in result["final_metrics"]


def test_no_rank_exits_before_rank_0_has_saved_at_a_stop(tmp_path):
    """Rank 1 has nothing to write at the stop and used to exit 143 at once, 3 s before rank 0's
    save was done: torchrun's agent or srun --kill-on-bad-exit then ends rank 0 mid-save."""
    proc, work = _run(tmp_path, "+hooks.slow._target_=ends.SlowLastSave")
    assert proc.returncode != 0, proc.output[-3000:]
    result = json.loads((work / "result.json").read_text())
    assert (result["status"], result["iter"]) == ("stopped", 16), result
    saved = float((tmp_path / "saved_rank0.txt").read_text())
    left = float((tmp_path / "exit_rank1.txt").read_text())
    assert left >= saved, f"rank 1 exited {saved - left:.2f} s before rank 0's save at the stop was done"
    assert (work / "checkpoints" / "iter_16.pth").is_file()


ASK = """
import json, os
from expkit.core import distributed

distributed.init(timeout_s=60)
rank = distributed.rank()


def ask(main):
    with open(f"asked_rank{rank}_{main}.txt", "a") as f:
        f.write("asked\\n")
    return {"by": rank, "main": main}


with open(f"answer{rank}.json", "w") as f:
    json.dump(distributed.asked_once(ask), f)
distributed.barrier()
if rank == 0:
    os._exit(0)  # gone (a failed node): rank 1's next question gets no answer from it
with open(f"answer{rank}_alone.json", "w") as f:
    json.dump(distributed.asked_once(ask), f)
# its answer is written; the interpreter's teardown of a gloo group whose peer is gone can abort in
# C++ ("terminate called without an active exception", exit -6: once in a full suite's run)
os._exit(0)
"""


def test_slurm_is_asked_by_rank_0_for_every_rank_and_by_a_rank_whose_rank_0_is_gone(tmp_path):
    """The job's end time at the start and "requeue or cancel?" at a SIGTERM are asked of slurmctld
    once per job (distributed.asked_once), not once per rank: 512 ranks sent it 512 scontrol calls at
    once. A rank that cannot get rank 0's answer asks itself."""
    (tmp_path / "ask.py").write_text(ASK)
    proc = torchrun("ask.py", cwd=tmp_path, module=None, timeout=120)
    assert proc.returncode == 0, proc.output[-3000:]
    answers = [json.loads((tmp_path / name).read_text()) for name in ("answer0.json", "answer1.json")]
    assert answers == [{"by": 0, "main": True}] * 2  # rank 0's answer, on both
    asked = sorted(p.name for p in tmp_path.glob("asked_*"))
    assert asked == ["asked_rank0_True.txt", "asked_rank1_False.txt"], asked  # rank 1 asked only once rank 0 was gone
    assert json.loads((tmp_path / "answer1_alone.json").read_text()) == {"by": 1, "main": False}
