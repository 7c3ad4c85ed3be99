"""python -m expkit.dashboard over a real Optuna search's journal: optuna-dashboard answers
/api/studies with the search's study and its trials, and Ctrl-C ends it with exit 0; a dir that
is no search is refused with one line, exit 2."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import run_cli, run_module

SEARCH = ["hparams_search=optuna", "trainer.max_epochs=1", "data.batch_size=64", "hydra.sweeper.n_trials=2"]


def _url(server: subprocess.Popen, timeout: float = 60) -> str:
    """The URL the dashboard prints on its stdout."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([server.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = server.stdout.readline() if ready else ""
        if not line and server.poll() is not None:
            break
        seen.append(line)
        if "http://" in line:
            return line.split("http://", 1)[1].split()[0].rstrip("/")
    server.kill()
    pytest.fail(f"no URL printed: {''.join(seen)} {server.stderr.read()}")


@pytest.mark.slow
def test_the_dashboard_serves_the_searchs_journal_study_and_stops_on_ctrl_c(tmp_path):
    # a relative sweep dir: the search records its journal as "outputs/search/optuna.journal"
    proc = run_cli("-m", *SEARCH, "hydra.sweep.dir=outputs/search", cwd=tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    sweep = tmp_path / "outputs" / "search"
    assert (sweep / "optuna.journal").is_file()
    server = subprocess.Popen(
        [sys.executable, "-m", "expkit.dashboard", str(sweep), "port=0"],  # (0: a free port; the URL says which)
        cwd=tmp_path.parent,  # elsewhere: the recorded relative journal is found in the sweep dir
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
    )
    try:
        url = _url(server)
        assert url.startswith("127.0.0.1:")
        with urllib.request.urlopen(f"http://{url}/api/studies", timeout=10) as response:
            studies = json.loads(response.read())["study_summaries"]
        (study,) = studies
        assert study["study_name"] == "expkit" and study["directions"] == ["maximize"]
        with urllib.request.urlopen(f"http://{url}/api/studies/{study['study_id']}?after=0", timeout=10) as r:
            trials = json.loads(r.read())["trials"]
        assert [t["state"] for t in trials] == ["Complete", "Complete"]
        server.send_signal(signal.SIGINT)  # Ctrl-C
        assert server.wait(timeout=20) == 0, server.stderr.read()
        assert "Traceback" not in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert not list(tmp_path.parent.glob("*.journal*"))  # nothing made where it ran


def test_a_dir_that_is_no_search_exits_2_with_one_line(tmp_path):
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "multirun.yaml").write_text("hydra:\n  sweeper:\n    _target_: hydra._internal.BasicSweeper\n")
    for args, named in (
        ([str(tmp_path / "grid")], "not the sweep dir of an Optuna search"),
        ([str(tmp_path / "nowhere")], "no such dir"),
        ([], "give the search's sweep dir"),
    ):
        proc = run_module("expkit.dashboard", *args, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, proc.output
        lines = [line for line in proc.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and named in lines[0], proc.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid"]
