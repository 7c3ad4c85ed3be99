"""The readers of a work dir's records (``expkit.workdir.records``): one behaviour for a missing,
torn or foreign file, as a kill or another program leaves one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expkit.workdir.records import (
    BEST_FILE,
    JOB_FILE,
    METRICS_FILE,
    RESULT,
    read_best,
    read_job,
    read_records,
    read_result,
)

OBJECT_READERS = [(read_result, RESULT), (read_job, JOB_FILE), (read_best, BEST_FILE)]
BROKEN = {
    "truncated": b'{"status": "compl',
    "a list instead of an object": b"[1, 2]",
    "a string": b'"completed"',
    "torn bytes": '{"status": "ok\udcff"}'.encode("utf-8", "surrogateescape"),
    "empty": b"",
}


@pytest.mark.parametrize(("read", "name"), OBJECT_READERS)
def test_an_object_record_reads_as_its_content(tmp_path: Path, read, name):
    (tmp_path / name).write_text(json.dumps({"status": "completed", "value": 0.5}))
    assert read(tmp_path) == {"status": "completed", "value": 0.5}


@pytest.mark.parametrize(("read", "name"), OBJECT_READERS)
def test_a_missing_object_record_reads_as_none(tmp_path: Path, read, name):
    assert read(tmp_path) is None
    assert read(tmp_path / "no such dir") is None


@pytest.mark.parametrize(("read", "name"), OBJECT_READERS)
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_truncated_or_foreign_object_record_reads_as_none(tmp_path: Path, read, name, broken):
    (tmp_path / name).write_bytes(BROKEN[broken])
    assert read(tmp_path) is None


@pytest.mark.parametrize(("read", "name"), OBJECT_READERS)
def test_a_dir_in_place_of_an_object_record_reads_as_none(tmp_path: Path, read, name):
    (tmp_path / name).mkdir()
    assert read(tmp_path) is None


def test_metrics_jsonl_reads_every_record_in_order(tmp_path: Path):
    records = [{"iter": i, "train/loss": 1.0 / (i + 1)} for i in range(3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_records(tmp_path) == records


def test_a_missing_metrics_jsonl_reads_as_no_records(tmp_path: Path):
    assert read_records(tmp_path) == []
    (tmp_path / METRICS_FILE).mkdir()  # (unreadable as a file)
    assert read_records(tmp_path) == []


def test_the_torn_last_line_of_a_killed_run_is_skipped(tmp_path: Path):
    whole = [{"iter": 0, "train/loss": 1.0}, {"iter": 1, "train/loss": 0.5}]
    text = "".join(json.dumps(r) + "\n" for r in whole) + '{"iter": 2, "train/lo'
    (tmp_path / METRICS_FILE).write_text(text)
    assert read_records(tmp_path) == whole
    # a character cut inside its bytes: the line is skipped, the rest of the file still reads
    (tmp_path / METRICS_FILE).write_bytes(text.encode()[:-13] + '{"x": "é'.encode()[:-1])
    assert read_records(tmp_path) == whole


def test_lines_that_are_not_json_objects_are_skipped(tmp_path: Path):
    lines = ['{"iter": 0}', "[1, 2]", "", "3", "not json", '{"iter": 1}']
    (tmp_path / METRICS_FILE).write_text("\n".join(lines) + "\n")
    assert read_records(tmp_path) == [{"iter": 0}, {"iter": 1}]


def test_curves_are_drawn_from_a_metrics_file_with_a_torn_last_line(tmp_path):
    from expkit.hooks.logger import plot_curves

    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "train/loss": 1.0 / s}) for s in (1, 2, 3)] + ['{"step": 4, "train/lo']
    metrics.write_text("\n".join(lines))
    plot_curves(metrics, tmp_path / "curves.svg")  # (it raised JSONDecodeError on the torn line)
    assert (tmp_path / "curves.svg").read_text().startswith("<svg")
