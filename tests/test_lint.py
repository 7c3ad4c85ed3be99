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
