"""ruff (lint and format, settings in pyproject.toml) passes on the whole repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")  # the venv's ruff, pinned in constraints.txt
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: run `bash scripts/setup.sh` (the dev extra installs it)")
    return [found]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_passes(args):
    proc = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, (
        f"ruff {' '.join(args)} failed; `ruff {args[0]} --fix .` or `ruff format .`:\n{proc.stdout}{proc.stderr}"
    )


def test_the_formatter_is_switched_off_nowhere_without_a_reason():
    """`# fmt: skip` keeps a line out of ruff's formatting: at most a handful in the repository,
    each followed by its reason (`# fmt: skip  (why)`)."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    skips = [
        f"{name}:{number}: {line.strip()}"
        for name in tracked
        if (ROOT / name).is_file() and name != "tests/test_lint.py"  # (this file names the markers)
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1)
        if "# fmt: skip" in line or "# fmt: off" in line
    ]
    without_reason = [s for s in skips if not s.split("# fmt: ", 1)[1].split(None, 1)[1:]]
    assert len(skips) <= 5 and not without_reason, "\n".join(skips)
