"""``data=webdataset``: WebDataset tar shards written by ``webdataset.ShardWriter`` (directly, and by
``python -m expkit.shards``), trained from on a local disk and in S3 (a real moto server),
killed mid-epoch and resumed exactly (with workers; on another number of processes), read in
bounded memory, and every bad input refused in one line."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, S3, SEEN_PROBE, digit_shards_command, run_cli, run_module, seen_samples, torchrun

pytestmark = pytest.mark.slow
pytest.importorskip("webdataset")


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory) -> tuple[Path, list[str]]:
    """The digits as shards (``expkit.shards``, 300 samples each) and the overrides it printed."""
    out = tmp_path_factory.mktemp("digits") / "shards"
    proc = digit_shards_command(out)
    printed = proc.stdout.strip().splitlines()[-1].split("python -m expkit.train ", 1)[1]
    overrides = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', printed)]
    return out, overrides


def test_the_shards_command_writes_what_webdataset_itself_reads_back(digit_shards):
    import webdataset

    from expkit.data import DigitsData

    out, overrides = digit_shards
    assert sorted(p.name for p in out.iterdir()) == [
        "test-000000.tar",
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
        "train-000003.tar",
        "train-000004.tar",
        "val-000000.tar",
    ]
    assert overrides[0] == "data=webdataset" and f"data.train='{out}/train-{{000000..000004}}.tar'" in overrides
    train, _, _ = DigitsData().datasets()
    read = list(webdataset.WebDataset(f"{out}/train-{{000000..000004}}.tar", shardshuffle=False))
    assert len(read) == len(train) == 1258
    for i in (0, 299, 300, 1257):  # in order, across shard boundaries
        x, y = train[i]
        assert np.array_equal(np.load(io.BytesIO(read[i]["npy"])), x.numpy()) and int(read[i]["cls"]) == int(y)


def test_png_shards_written_by_shardwriter_train_and_their_index_is_cached(tmp_path):
    import webdataset
    from PIL import Image

    g = np.random.default_rng(0)
    with webdataset.ShardWriter(str(tmp_path / "img-%06d.tar"), maxcount=40, verbose=0) as sink:
        for i in range(100):
            label = i % 4
            image = (g.random((12, 12, 3)) * 60 + label * 60).astype(np.uint8)  # a class is a brightness
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="PNG")
            sink.write({"__key__": f"{i:05d}", "png": buffer.getvalue(), "cls": str(label).encode()})
    args = [
        "data=webdataset",
        f"data.train='{tmp_path}/img-{{000000..000002}}.tar'",
        f"data.val={tmp_path}/img-000002.tar",
        "data.num_classes=4",
        "data.num_workers=0",
        "trainer.max_epochs=2",
        f"data.index_dir={tmp_path / 'index'}",
    ]
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", *args)
    assert proc.returncode == 0, proc.output[-3000:]
    assert "Indexed 3 of 3 shards of data.train" in proc.output
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "completed" and result["epoch"] == 2
    again = run_cli(f"hydra.run.dir={tmp_path / 'again'}", *args)
    assert again.returncode == 0 and "Indexed" not in again.output  # read from the cache


def test_a_run_killed_mid_epoch_with_two_workers_resumes_exactly(digit_shards, tmp_path):
    from expkit.testing import assert_resumes_exactly

    _, overrides = digit_shards
    report = assert_resumes_exactly(
        *overrides, "data.num_workers=2", f"data.index_dir={tmp_path / 'index'}", scratch=tmp_path
    )
    assert report["ok"]


def test_killed_on_two_processes_and_resumed_on_one_every_sample_once(digit_shards, tmp_path):
    _, overrides = digit_shards
    (tmp_path / "seenprobe.py").write_text(SEEN_PROBE)
    env = {"PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    common = [
        *overrides,
        "+hooks.seen._target_=seenprobe.Seen",
        "trainer.max_epochs=1",
        "data.num_workers=0",
        f"data.index_dir={tmp_path / 'index'}",
        "default_hooks.logger.plot=false",
    ]
    whole = run_cli(*common, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.output[-3000:]
    work = tmp_path / "run"
    stopped = torchrun(
        *common,
        f"hydra.run.dir={work}",
        "+hooks.stop._target_=expkit.hooks.StopAfterHook",
        "+hooks.stop.iters=7",
        cwd=tmp_path,
        nproc=2,
        env=env,
        timeout=400,
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert sum(seen_samples(work).values()) == 7 * 32 * 2
    resumed = run_cli(*common, f"hydra.run.dir={work}", "resume=true", "~hooks.stop", cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "(saved with 2 processes, now 1)" in (work / "train.log").read_text()
    seen, reference = seen_samples(work), seen_samples(tmp_path / "whole")
    assert seen == reference  # every sample of the epoch once, none twice (1 process: no padding)


def test_shards_in_s3_train_and_a_missing_bucket_or_dead_endpoint_exits_2(digit_shards, tmp_path, monkeypatch):
    pytest.importorskip("s3fs")
    from expkit.data.shards import ShardReadError, WebDatasetData

    out, _ = digit_shards
    server = S3(tmp_path)
    try:
        fs = server.fs()
        fs.mkdir("shards")
        for shard in sorted(out.glob("*.tar")):
            fs.put(str(shard), f"shards/{shard.name}")
        args = [
            "data=webdataset",
            "data.train='s3://shards/train-{000000..000004}.tar'",
            "data.val=s3://shards/val-000000.tar",
            "data.num_workers=2",
            "trainer.max_epochs=1",
            f"data.index_dir={tmp_path / 'index'}",
        ]
        proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", *args, env=server.env)
        assert proc.returncode == 0, proc.output[-3000:]
        assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"
        missing = run_cli(
            f"hydra.run.dir={tmp_path / 'm'}", *args[:1], "data.train=s3://nobucket/train-000000.tar", env=server.env
        )
        assert missing.returncode == 2 and "s3://nobucket/train-000000.tar" in missing.stderr, missing.output[-2000:]
        # the store goes down in the middle of a run (issue 64, item 13): the error says so, and names no
        # damaged shard; on_error=skip does not skip it (an outage would drop samples without a word)
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        train = WebDatasetData(
            train="s3://shards/train-{000000..000004}.tar", index_dir=str(tmp_path / "index"), on_error="skip"
        ).datasets()[0]
        assert len(train[0]) == 2  # read while the store is up
    finally:
        server.stop()
    with pytest.raises(ShardReadError) as outage:
        train[len(train) - 1]  # (a shard not opened yet)
    assert "the store did not answer or refused the read" in str(outage.value)
    assert "s3://shards/train-000004.tar" in str(outage.value) and "Replace the shard" not in str(outage.value)
    dead = run_cli(f"hydra.run.dir={tmp_path / 'd'}", *args, env=server.env)  # (the endpoint is gone now)
    assert dead.returncode == 2 and "s3://shards/train-000000.tar" in dead.stderr, dead.output[-2000:]
    assert "Traceback" not in missing.output + dead.output


def test_bad_shards_exit_2_in_one_line_and_a_corrupt_sample_mid_run_names_its_shard(tmp_path, digit_shards):
    import webdataset

    out, _ = digit_shards
    (tmp_path / "trunc.tar").write_bytes((out / "train-000000.tar").read_bytes()[:100_000])
    with webdataset.ShardWriter(str(tmp_path / "nokey-%06d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(3):
            sink.write({"__key__": f"s{i}", "txt": b"hello", "cls": b"1"})
    cases = {
        f"'{tmp_path}/none-{{000000..000001}}.tar'": "none-000000.tar does not exist",
        str(tmp_path / "trunc.tar"): "trunc.tar is not a readable tar",
        str(tmp_path / "nokey-000000.tar"): "nokey-000000.tar: its first sample has no input member",
    }
    for spec, expected in cases.items():
        proc = run_cli(f"hydra.run.dir={tmp_path / 'bad'}", "data=webdataset", f"data.train={spec}")
        assert proc.returncode == 2 and expected in proc.stderr, proc.output[-2000:]
        assert "Traceback" not in proc.output and not (tmp_path / "bad" / "checkpoints").exists()
        shutil.rmtree(tmp_path / "bad", ignore_errors=True)

    with webdataset.ShardWriter(str(tmp_path / "corrupt-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(100):
            buffer = io.BytesIO()
            np.save(buffer, np.full((1, 8, 8), i / 100, dtype=np.float32))
            sink.write({"__key__": f"s{i:04d}", "npy": buffer.getvalue() if i != 70 else b"garbage", "cls": b"1"})
    args = [
        "data=webdataset",
        f"data.train={tmp_path}/corrupt-000000.tar",
        "trainer.max_epochs=1",
        "data.shuffle_buffer=0",
    ]
    failed = run_cli(f"hydra.run.dir={tmp_path / 'c'}", *args, "data.num_workers=2")
    assert failed.returncode == 1, failed.output[-2000:]
    assert "corrupt-000000.tar: sample 70 of the shard cannot be read" in failed.stderr, failed.stderr[-2000:]
    assert json.loads((tmp_path / "c" / "result.json").read_text())["status"] == "failed"
    skipped = run_cli(f"hydra.run.dir={tmp_path / 's'}", *args, "data.on_error=skip", "data.num_workers=0")
    assert skipped.returncode == 0 and "Skipped: " in skipped.output and "sample 70" in skipped.output


MEMORY = """
import json, resource, sys
import torch
from torch.utils.data import DataLoader
from expkit.data.shards import WebDatasetData

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
data = WebDatasetData(train=sys.argv[1], num_classes=2, num_workers=0, batch_size=8, index_dir=sys.argv[2])
train, _, _ = data.datasets()
count = 0
for x, y in DataLoader(train, batch_size=8, sampler=data.train_sampler(train, 0, 1)):
    count += len(y)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"samples": count, "grew_mb": (after - before) / 1024, "input": list(x.shape)}))
"""


def test_a_gigabyte_of_shards_is_read_in_bounded_memory(tmp_path):
    import webdataset

    sample = np.zeros((4, 256, 256), dtype=np.float32)  # 1 MiB each
    buffer = io.BytesIO()
    np.save(buffer, sample)
    payload = buffer.getvalue()
    with webdataset.ShardWriter(str(tmp_path / "big-%06d.tar"), maxcount=128, verbose=0) as sink:
        for i in range(1024):
            sink.write({"__key__": f"{i:05d}", "npy": payload, "cls": str(i % 2).encode()})
    assert sum(p.stat().st_size for p in tmp_path.glob("big-*.tar")) > 2**30
    (tmp_path / "memory.py").write_text(MEMORY)
    proc = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "memory.py"),
            f"{tmp_path}/big-{{000000..000007}}.tar",
            str(tmp_path / "index"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert measured["samples"] == 1024 and measured["input"] == [8, 4, 256, 256]
    assert measured["grew_mb"] < 300, measured  # a few batches in flight, never the gigabyte


@pytest.mark.long(seconds=64)
def test_the_check_passes_on_shards_under_torchrun(digit_shards, tmp_path):
    _, overrides = digit_shards
    proc = torchrun(
        *overrides,
        "data.num_workers=1",
        f"data.index_dir={tmp_path / 'index'}",
        f"check.dir={tmp_path / 'scratch'}",
        f"check.out={tmp_path / 'check.json'}",
        cwd=tmp_path,
        module="expkit.check",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["ok"] and all(r["result"] in ("ok", "info") for r in report["rows"]), report


def write_shards(pattern: Path, inputs: list[np.ndarray], labels: list[int], per_shard: int = 100) -> list[Path]:
    """`inputs` (as .npy) and `labels` (as .cls) written with ``webdataset.ShardWriter``, as users write theirs."""
    import webdataset

    written: list[str] = []
    with webdataset.ShardWriter(str(pattern), maxcount=per_shard, verbose=0, post=written.append) as sink:
        for i, (x, y) in enumerate(zip(inputs, labels)):
            sink.write({"__key__": f"s{i:05d}", "npy": x, "cls": str(y).encode()})
    return [Path(p) for p in written]


def test_uint8_arrays_train_as_floats_in_0_1_and_other_integer_arrays_exit_2(tmp_path):
    """Issue 64, 1: uint8 arrays (how images are stored) trained as Byte and failed at the first step."""
    from expkit.data.shards import WebDatasetData

    g = np.random.default_rng(0)
    images = [g.integers(0, 256, (3, 8, 8)).astype(np.uint8) for _ in range(60)]
    (shard,) = write_shards(tmp_path / "u8-%06d.tar", images, [i % 3 for i in range(60)])
    data = WebDatasetData(train=str(shard), num_classes=3, index_dir=str(tmp_path / "index"))
    x, y = data.datasets()[0][5]
    assert x.dtype == torch.float32 and torch.equal(x, torch.from_numpy(images[5]).float() / 255) and y == 2
    args = [
        "data=webdataset",
        f"data.train={shard}",
        "data.num_classes=3",
        "data.num_workers=0",
        "trainer.max_epochs=1",
    ]
    proc = run_cli(f"hydra.run.dir={tmp_path / 'run'}", *args, f"data.index_dir={tmp_path / 'index'}")
    assert proc.returncode == 0, proc.output[-2000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "completed"

    (wide,) = write_shards(tmp_path / "i16-%06d.tar", [x.astype(np.int16) for x in images], [0, 1, 2] * 20)
    refused = run_cli(f"hydra.run.dir={tmp_path / 'i16'}", *args, f"data.train={wide}")
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output[-2000:]
    assert "the .npy inputs are int16 arrays" in refused.stderr and not (tmp_path / "i16" / "checkpoints").exists()


def test_skip_leaves_out_what_a_cut_tar_cannot_give_and_counts_it_in_result_json(tmp_path):
    """Issue 64, 2: a truncated tar stopped a run with data.on_error=skip; what it cannot give is skipped, counted."""
    g = np.random.default_rng(0)
    arrays = [g.random((1, 8, 8)).astype(np.float32) for _ in range(100)]
    (whole,) = write_shards(tmp_path / "whole-%06d.tar", arrays, [i % 2 for i in range(100)])
    import tarfile

    with tarfile.open(whole) as tar:
        npy = {m.name: m.offset_data for m in tar if m.name.endswith(".npy")}
    data = whole.read_bytes()
    (tmp_path / "last.tar").write_bytes(data[: npy["s00099.npy"] + 100])  # into the last member's data
    (tmp_path / "tail.tar").write_bytes(data[: npy["s00050.npy"] - 200])  # half the shard, cut in a header
    args = ["data=webdataset", "data.num_workers=2", "trainer.max_epochs=1", "data.batch_size=8"]
    for name in ("last", "tail"):
        shard = tmp_path / f"{name}.tar"
        refused = run_cli(f"hydra.run.dir={tmp_path / ('r' + name)}", *args, f"data.train={shard}")
        assert refused.returncode == 2 and f"{shard} is not a readable tar" in refused.stderr, refused.output[-2000:]
        assert "data.on_error=skip" in refused.stderr and "Traceback" not in refused.output
        skip = [f"data.train={whole}::{shard}", f"data.val={shard}", "data.on_error=skip"]
        proc = run_cli(f"hydra.run.dir={tmp_path / name}", *args, *skip)
        assert proc.returncode == 0, proc.output[-3000:]
        result = json.loads((tmp_path / name / "result.json").read_text())
        assert result["status"] == "completed" and result["skipped_samples"] == {"train": 1, "val": 1}, result
        assert f"Skipped: {shard}: 1 samples cannot be read" in proc.output


def test_labels_past_num_classes_exit_2_naming_the_key_and_the_largest_label(tmp_path, digit_shards):
    """Issue 64, 3: a label >= data.num_classes failed at the first step (IndexError: Target 10 is out of bounds)."""
    _, overrides = digit_shards
    proc = run_cli(f"hydra.run.dir={tmp_path / 'five'}", *overrides, "data.num_classes=5", "data.num_workers=0")
    assert proc.returncode == 2 and "Traceback" not in proc.output, proc.output[-2000:]
    assert "data.num_classes=5, but the largest label is 9" in proc.stderr and "set data.num_classes=10" in proc.stderr
    assert not (tmp_path / "five" / "checkpoints").exists()
    (shard,) = write_shards(tmp_path / "neg-%06d.tar", [np.zeros((1, 4, 4), np.float32)] * 4, [0, 1, -1, 1])
    negative = run_cli(f"hydra.run.dir={tmp_path / 'neg'}", "data=webdataset", f"data.train={shard}")
    assert negative.returncode == 2 and "the label -1 in data.train: " in negative.stderr, negative.output[-2000:]


def test_a_directory_for_a_shard_and_a_missing_or_file_out_exit_2_in_one_line(tmp_path, digit_shards):
    """Issue 64, 4: IsADirectoryError (exit 1), and Hydra's traceback for python -m expkit.shards without a dir."""
    out, _ = digit_shards
    proc = run_cli(f"hydra.run.dir={tmp_path / 'dir'}", "data=webdataset", f"data.train={out}")
    assert proc.returncode == 2 and f"data.train: {out} is a directory, not a tar shard" in proc.stderr, proc.output
    assert "Traceback" not in proc.output
    (tmp_path / "a_file").write_text("")
    for args, expected in (
        ([], "Error: out is required"),
        ([f"out={tmp_path / 'a_file'}"], "is a file, not a dir"),
        ([f"out={tmp_path / 'a_file' / 'x'}"], "a parent of it is a file"),
    ):
        shards = subprocess.run(
            [sys.executable, "-m", "expkit.shards", *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert shards.returncode == 2 and expected in shards.stderr, shards.stdout + shards.stderr
        assert len(shards.stderr.strip().splitlines()) == 1 and "Traceback" not in shards.stderr


@pytest.mark.parametrize(
    ("group", "target"),
    [("shapes", "a whole-number target of shape (32, 32)"), ("diabetes", "a torch.float32 value as its target")],
)
def test_data_that_is_not_classification_exits_2_in_one_line_and_writes_no_shard(tmp_path, group, target):
    """A mask per sample (shapes) crashed with a traceback and left a cut tar; a regression value
    (diabetes) was written truncated to an int class, which training then refused."""
    out = tmp_path / "shards"
    shards = run_module("expkit.shards", f"out={out}", f"data={group}", timeout=120)
    assert shards.returncode == 2, shards.output
    assert f"Error: data={group}: the train split's sample 0 has {target}, not a class" in shards.stderr, shards.stderr
    assert len(shards.stderr.strip().splitlines()) == 1 and "Traceback" not in shards.stderr
    assert not list(out.glob("*.tar"))


def test_a_shard_replaced_with_the_same_size_and_time_is_indexed_again_and_refuses_a_resume(digit_shards, tmp_path):
    """Issue 64, 5: ``cp -p`` of other content over a shard kept the stale index, and a resume mixed two datasets."""
    import os

    out, overrides = digit_shards
    shards = tmp_path / "shards"
    shutil.copytree(out, shards)
    overrides = [o.replace(str(out), str(shards)) for o in overrides]
    common = [*overrides, "data.num_workers=0", f"data.index_dir={tmp_path / 'index'}", "trainer.max_epochs=1"]
    work = tmp_path / "run"
    stop = ["+hooks.stop._target_=expkit.hooks.StopAfterHook", "+hooks.stop.iters=5"]
    stopped = run_cli(*common, f"hydra.run.dir={work}", *stop)
    assert stopped.returncode == 0, stopped.output[-3000:]
    replaced, other = shards / "train-000001.tar", shards / "train-000002.tar"
    assert replaced.stat().st_size == other.stat().st_size and replaced.read_bytes() != other.read_bytes()
    st = replaced.stat()
    replaced.write_bytes(other.read_bytes())  # another shard's samples, the size and the time kept (cp -p)
    os.utime(replaced, ns=(st.st_atime_ns, st.st_mtime_ns))
    resumed = run_cli(*common, f"hydra.run.dir={work}", "resume=true", "~hooks.stop")
    assert resumed.returncode == 2 and "Traceback" not in resumed.output, resumed.output[-3000:]
    assert f"the data changed: {replaced} is not the shard the checkpoint's run trained on" in resumed.stderr
    assert "Indexed 1 of 5 shards of data.train" in resumed.output  # (not read through the stale index)
