"""docs/sweeps-in-practice.md: every command of the page, in order, from a clean directory,
with the exit status the page writes after it."""

from __future__ import annotations

import csv
import json
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow
PAGE = REPO / "docs" / "sweeps-in-practice.md"


def _commands() -> list[tuple[list[str], int]]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.DOTALL):
        for line in block.splitlines():
            command, _, status = line.partition("  # exit ")
            if command.startswith(".venv/bin/python"):  # (`<seeds>`: the page's seeds sweep)
                commands.append((shlex.split(command.replace("<seeds>", "seeds")), int(status.split()[0])))
    return commands


def test_the_page_commands_do_what_it_says(tmp_path):
    commands = _commands()
    assert len(commands) == 8
    for argv, expected in commands:
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == expected, (argv, proc.stdout[-2000:], proc.stderr[-2000:])
        if expected == 2:
            assert "already holds sweep jobs: 3 completed, 0 interrupted, 0 failed" in proc.stderr
    sweeps = tmp_path / "outputs" / "sweeps"
    statuses = {
        j.name: json.loads((j / "result.json").read_text())["status"]
        for j in (sweeps / "fails").iterdir()
        if j.name.isdigit()
    }
    assert statuses == {"0": "completed", "1": "failed"}
    assert (sweeps / "fails" / "1" / "train.log").read_text().count("Job failed") == 2  # retried, in its dir
    per_job = list(csv.DictReader((sweeps / "seeds" / "summary.csv").open()))  # the last command: seed_keys=[]
    assert len(per_job) == 6
    grouped = subprocess.run(
        [sys.executable, "-m", "expkit.sweep", str(sweeps / "seeds"), "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert grouped.returncode == 0 and json.loads((sweeps / "seeds" / "best.json").read_text())["n"] == 3
