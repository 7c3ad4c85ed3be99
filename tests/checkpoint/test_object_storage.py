"""Checkpoints in object storage: a real S3 API (moto's server on 127.0.0.1, with authentication),
reached through s3fs exactly as a user reaches a bucket: endpoint and credentials from the
standard AWS variables, or from default_hooks.checkpoint.storage_options."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import S3, run_cli, torchrun

pytest.importorskip("s3fs")
pytest.importorskip("moto")

pytestmark = pytest.mark.slow
BUCKET = S3.BUCKET


@pytest.fixture
def s3(tmp_path):
    server = S3(tmp_path)
    try:
        yield server
    finally:
        server.stop()


COMMON = ["trainer.max_epochs=3", f"default_hooks.checkpoint.out_dir=s3://{BUCKET}/runs"]


def _stored(s3: S3, run: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(f"{BUCKET}/runs/{run}"))


def _same_weights(a: Path, b: Path) -> bool:
    x, y = (torch.load(p, weights_only=True)["state_dict"] for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_checkpoints_retention_and_the_pointer_land_in_the_bucket_and_resume_elsewhere(tmp_path, s3, async_save):
    reference = tmp_path / "reference" / "run"
    assert run_cli(f"hydra.run.dir={reference}", "trainer.max_epochs=5").returncode == 0
    work = tmp_path / "a" / "run"
    args = [f"hydra.run.dir={work}", *COMMON, f"default_hooks.checkpoint.async_save={async_save}"]
    first = run_cli(*args, env=s3.env)
    assert first.returncode == 0, first.output
    assert "uploaded to s3://ckpts/runs/run" in first.output
    # what the local dir keeps, the bucket keeps: max_keep_ckpts=2, the best, the pointer
    local = sorted(p.name for p in (work / "checkpoints").iterdir() if not p.name.startswith("."))
    assert _stored(s3, "run") == local == ["best_val_acc_epoch_2.pth", "epoch_2.pth", "epoch_3.pth", "last_checkpoint"]
    assert s3.fs().cat(f"{BUCKET}/runs/run/last_checkpoint") == b"epoch_3.pth"
    assert s3.fs().cat(f"{BUCKET}/runs/run/epoch_3.pth") == (work / "checkpoints" / "epoch_3.pth").read_bytes()

    # another machine: the same run dir name, nothing local; resume=true downloads what the bucket names
    elsewhere = tmp_path / "b" / "run"
    resumed = run_cli(f"hydra.run.dir={elsewhere}", *args[1:], "trainer.max_epochs=5", "resume=true", env=s3.env)
    assert resumed.returncode == 0, resumed.output
    assert "Resumed from" in resumed.output and "epoch_3.pth at epoch 3" in resumed.output
    assert _stored(s3, "run") == ["best_val_acc_epoch_5.pth", "epoch_4.pth", "epoch_5.pth", "last_checkpoint"]
    assert _same_weights(elsewhere / "checkpoints" / "epoch_5.pth", reference / "checkpoints" / "epoch_5.pth")
    result = json.loads((elsewhere / "result.json").read_text())
    assert result["status"] == "completed" and result["epoch"] == 5


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_sharded_checkpoint_is_uploaded_whole_and_resumes_on_another_machine(tmp_path, s3, async_save):
    work = tmp_path / "a" / "run"
    args = [
        *COMMON,
        f"default_hooks.checkpoint.async_save={async_save}",
        "trainer.strategy=fsdp",
        "trainer.max_epochs=2",
    ]
    first = run_cli(f"hydra.run.dir={work}", *args, env=s3.env)
    assert first.returncode == 0, first.output
    local = sorted(
        p.relative_to(work / "checkpoints" / "epoch_2.dcp").as_posix()
        for p in (work / "checkpoints" / "epoch_2.dcp").rglob("*")
        if p.is_file()
    )
    stored = sorted(p.split("epoch_2.dcp/", 1)[1] for p in s3.fs().find(f"{BUCKET}/runs/run/epoch_2.dcp"))
    assert stored == local and ".metadata" in stored and "state.pth" in stored
    assert s3.fs().cat(f"{BUCKET}/runs/run/last_checkpoint") == b"epoch_2.dcp"
    elsewhere = tmp_path / "b" / "run"
    resumed = run_cli(f"hydra.run.dir={elsewhere}", *args[:-1], "trainer.max_epochs=3", "resume=true", env=s3.env)
    assert resumed.returncode == 0, resumed.output
    assert "epoch_2.dcp at epoch 2" in resumed.output
    assert s3.fs().cat(f"{BUCKET}/runs/run/last_checkpoint") == b"epoch_3.dcp"


@pytest.mark.long(seconds=54)
def test_resume_from_the_local_cache_downloads_nothing_and_eval_reads_a_url(tmp_path, s3):
    work = tmp_path / "run"
    assert run_cli(f"hydra.run.dir={work}", *COMMON, env=s3.env).returncode == 0
    cached = (work / "checkpoints" / "epoch_3.pth").stat().st_mtime_ns
    resumed = run_cli(f"hydra.run.dir={work}", *COMMON, "trainer.max_epochs=4", "resume=true", env=s3.env)
    assert resumed.returncode == 0, resumed.output
    assert "Downloading" not in resumed.output and "Resumed from" in resumed.output
    # the local copy was read as it is: a download would have replaced the file (kept: epochs 3 and 4)
    assert (work / "checkpoints" / "epoch_3.pth").stat().st_mtime_ns == cached
    assert json.loads((work / "result.json").read_text())["epoch"] == 4

    tested = json.loads((work / "result.json").read_text())["final_metrics"]
    for run in (1, 2):  # the second evaluation reads the downloaded copy
        evaluated = subprocess.run(
            [
                sys.executable,
                "-m",
                "expkit.eval",
                f"checkpoint=s3://{BUCKET}/runs/run",
                "which=best",
                f"work_dir={tmp_path / f'eval{run}'}",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, **s3.env},
        )
        assert evaluated.returncode == 0, evaluated.stderr
        got = json.loads((tmp_path / f"eval{run}" / "result.json").read_text())["final_metrics"]
        assert got["test/acc"] == tested["test/acc"]

    out = tmp_path / "model.safetensors"  # expkit.export (and expkit.predict) resolve the URL as eval does
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.export",
            f"checkpoint=s3://{BUCKET}/runs/run/epoch_4.pth",
            f"out={out}",
            f"hydra.run.dir={tmp_path / 'export'}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **s3.env},
    )
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    weights = torch.load(work / "checkpoints" / "epoch_4.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(load_file(out)[k], weights[k]) for k in weights)

    # two torchrun ranks on this host: the lowest downloads into the host's cache, the other takes its copy
    # without a word to the store (given an endpoint where nothing listens, it could not download)
    site = tmp_path / "rank1_offline"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    os.environ['AWS_ENDPOINT_URL'] = 'http://127.0.0.1:9'\n"
    )
    fine = tmp_path / "fine"
    loaded = torchrun(
        f"hydra.run.dir={fine}",
        "trainer.max_epochs=1",
        f"load_from=s3://{BUCKET}/runs/run/epoch_4.pth",
        cwd=tmp_path,
        env={**s3.env, "TMPDIR": str(tmp_path), "PYTHONPATH": str(site)},  # (an empty cache: export filled one)
    )
    assert loaded.returncode == 0, loaded.output[-3000:]
    logs = [(fine / name).read_text() for name in ("train.log", "rank1.log")]
    assert all("Loaded weights from" in log for log in logs), logs
    assert logs[0].count("Downloading") == 1 and "Downloading" not in logs[1], logs

    # expkit.check: its three runs (and the resume) start from the same stored weights
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "expkit.check",
            f"load_from=s3://{BUCKET}/runs/run/epoch_4.pth",
            "check.keep=true",
            f"check.dir={tmp_path / 'scratch'}",
            f"check.out={tmp_path / 'check.json'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, **s3.env},
    )
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["ok"] is True and report["findings"] == []
    for run in ("a", "b", "c"):
        assert "Loaded weights from" in (Path(report["scratch"]) / run / "train.log").read_text()


def test_storage_options_in_the_config_instead_of_variables(tmp_path, s3):
    work = tmp_path / "run"
    env = {"AWS_CONFIG_FILE": s3.env["AWS_CONFIG_FILE"], "AWS_SHARED_CREDENTIALS_FILE": s3.env["AWS_CONFIG_FILE"]}
    proc = run_cli(
        f"hydra.run.dir={work}",
        "trainer.max_epochs=1",
        f"default_hooks.checkpoint.out_dir=s3://{BUCKET}/o",
        f"+default_hooks.checkpoint.storage_options.endpoint_url={s3.endpoint}",
        f"+default_hooks.checkpoint.storage_options.key={s3.key}",
        f"+default_hooks.checkpoint.storage_options.secret={s3.secret}",
        env=env,
    )
    assert proc.returncode == 0, proc.output
    assert s3.fs().cat(f"{BUCKET}/o/run/last_checkpoint") == b"epoch_1.pth"


@pytest.mark.parametrize(
    ("out_dir", "secret", "says"),
    [
        ("s3://no-such-bucket/runs", None, "The specified bucket does not exist"),
        (f"s3://{BUCKET}/runs", "wrong", "signature"),
    ],
)
def test_a_missing_bucket_or_bad_credentials_exit_2_before_training(tmp_path, s3, out_dir, secret, says):
    env = {**s3.env, **({"AWS_SECRET_ACCESS_KEY": secret} if secret else {})}
    proc = run_cli(
        f"hydra.run.dir={tmp_path / 'run'}",
        "trainer.max_epochs=1",
        f"default_hooks.checkpoint.out_dir={out_dir}",
        env=env,
    )
    assert proc.returncode == 2, proc.output
    assert f"default_hooks.checkpoint.out_dir={out_dir}: cannot write" in proc.stderr and says in proc.stderr
    assert "Traceback" not in proc.stderr and "Epoch(train)" not in proc.output


def _no_aws(tmp: Path) -> dict[str, str]:
    """The environment without any AWS setting of this machine's, and without its config files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_CONFIG_FILE": str(tmp / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none")}


def test_an_endpoint_that_accepts_and_never_answers_exits_2_within_seconds(tmp_path):
    # a store behind a dead proxy or a stuck load balancer: the connection opens, no answer ever comes
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    env = {
        **_no_aws(tmp_path),
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
    }
    try:
        started = time.monotonic()
        proc = run_cli(
            f"hydra.run.dir={tmp_path / 'run'}",
            "trainer.max_epochs=1",
            f"default_hooks.checkpoint.out_dir=s3://{BUCKET}/x",
            env=env,
            timeout=150,  # (without the probe's own deadline it waits upload_timeout, 1800 s)
        )
        took = time.monotonic() - started
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert proc.returncode == 2, proc.output
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "cannot write s3://ckpts/x/run/" in errors[0], proc.stderr
    assert "no answer within 10 s" in errors[0] and "AWS_ENDPOINT_URL" in errors[0]
    assert "Traceback" not in proc.stderr and "Epoch(train)" not in proc.output
    assert took < 90, took  # start-up (about 8 s on a loaded 2-core machine) and two probe calls at most


@pytest.mark.parametrize("store", ["without credentials", "unreachable"])
def test_eval_of_a_url_it_cannot_read_exits_2_in_one_line(tmp_path, s3, store):
    env = _no_aws(tmp_path)
    if store == "unreachable":
        with socket.socket() as s:  # (a port nothing listens on: the connection is refused)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(
            AWS_ACCESS_KEY_ID=s3.key, AWS_SECRET_ACCESS_KEY=s3.secret, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}"
        )
    else:
        env["AWS_ENDPOINT_URL"] = s3.endpoint
    proc = subprocess.run(
        [sys.executable, "-m", "expkit.eval", f"checkpoint=s3://{BUCKET}/run", f"work_dir={tmp_path / 'eval'}"],
        capture_output=True,
        text=True,
        env={**env, "AWS_DEFAULT_REGION": "us-east-1", "HYDRA_FULL_ERROR": "0"},
        timeout=150,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"checkpoint=s3://{BUCKET}/run: cannot list s3://{BUCKET}/run" in errors[0]
    says = "NoCredentialsError" if store == "without credentials" else "Could not connect to the endpoint URL"
    assert says in errors[0] and "AWS_ENDPOINT_URL" in errors[0], errors


STOP_SERVER = """
import os, signal
from expkit import Hook

class StopServer(Hook):
    '''Freezes the S3 server (SIGSTOP) as the second regular checkpoint is being saved.'''

    def __init__(self, pid: int):
        self.pid, self.saves = pid, 0

    def before_save_checkpoint(self, runner, *, checkpoint):
        self.saves += "optimizer" in checkpoint
        if self.saves == 2 and "optimizer" in checkpoint:
            os.kill(self.pid, signal.SIGSTOP)
"""


def test_a_store_that_stops_answering_mid_save_fails_the_run_and_loses_nothing(tmp_path, s3):
    (tmp_path / "stopserver.py").write_text(STOP_SERVER)
    reference = tmp_path / "reference"
    assert run_cli(f"hydra.run.dir={reference}", "trainer.max_epochs=3").returncode == 0
    work = tmp_path / "run"
    args = [
        f"hydra.run.dir={work}",
        *COMMON,
        "default_hooks.checkpoint.upload_timeout=5",
        "+default_hooks.checkpoint.storage_options.config_kwargs.read_timeout=2",
        "+default_hooks.checkpoint.storage_options.config_kwargs.connect_timeout=2",
        "+default_hooks.checkpoint.storage_options.config_kwargs.retries.max_attempts=1",
    ]
    failed = run_cli(
        *args,
        "+hooks.stop._target_=stopserver.StopServer",
        f"+hooks.stop.pid={s3.proc.pid}",
        env={**s3.env, "PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    s3.proc.send_signal(signal.SIGCONT)
    assert failed.returncode == 1, failed.output
    assert "could not upload epoch_2.pth to s3://ckpts/runs/run" in failed.stderr
    assert "s3://ckpts/runs/run/epoch_1.pth (and last_checkpoint there) is intact" in failed.stderr
    assert "Traceback" not in failed.stderr
    # the bucket's pointer names the previous checkpoint, which loads; nothing local was deleted
    assert s3.fs().cat(f"{BUCKET}/runs/run/last_checkpoint") == b"epoch_1.pth"
    s3.fs().get(f"{BUCKET}/runs/run/epoch_1.pth", str(tmp_path / "epoch_1.pth"))
    assert _same_weights(tmp_path / "epoch_1.pth", work / "checkpoints" / "epoch_1.pth")
    assert {"epoch_1.pth", "epoch_2.pth"} <= {p.name for p in (work / "checkpoints").iterdir()}
    # the server answers again: the run resumes from its newest local checkpoint and ends as if never stopped
    # (resume=true takes the run's own overrides, the stopping hook among them: this one leaves it out)
    resumed = run_cli(*args, "resume=true", "~hooks.stop", env=s3.env)
    assert resumed.returncode == 0, resumed.output
    assert "epoch_2.pth at epoch 2" in resumed.output
    assert _same_weights(work / "checkpoints" / "epoch_3.pth", reference / "checkpoints" / "epoch_3.pth")
    assert s3.fs().cat(f"{BUCKET}/runs/run/last_checkpoint") == b"epoch_3.pth"


@pytest.mark.parametrize(
    ("out_dir", "says"),
    [
        ("foo://bucket/runs", "unknown URL scheme foo://"),
        ("gs://bucket/runs", "pip install 'expkit[gcs]'"),
        ("s3://", "default_hooks.checkpoint.out_dir=s3://: the URL names no bucket; type s3://<bucket>/<prefix>"),
    ],
)
def test_an_unknown_scheme_a_missing_package_or_no_bucket_exits_2_in_one_line(tmp_path, out_dir, says):
    if out_dir.startswith("gs://"):
        try:
            import gcsfs  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("gcsfs is installed here")
    proc = run_cli(
        f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1", f"default_hooks.checkpoint.out_dir={out_dir}"
    )
    assert proc.returncode == 2, proc.output
    assert says in proc.stderr and "Traceback" not in proc.stderr
