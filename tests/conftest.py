"""Shared test helpers: a toy model and data small enough for unit tests in milliseconds."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra.core.plugins import Plugins
from torch import nn

from expkit.metrics import Metric
from expkit.testing import RecordingHook as Recorder  # noqa: F401 (the tests' name for it)
from expkit.testing import toy_loaders, toy_runner  # noqa: F401 (used by the tests)

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)

# The tests' Ctrl-C is a terminal's: the commands they start must hear SIGINT. A test run started
# as a shell's background job (`bash .ci/run &` in a script) inherits SIGINT ignored, and so would
# every process it starts (an ignored signal survives exec), which then ignores the tests' Ctrl-C
# and runs to its end: restore the default here, which exec resets to SIG_DFL in the children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Hydra's plugins, found once before any test runs: Hydra's test suites restore Hydra's singletons
# after each test, and on Hydra 1.4 a plugin scan first made inside one of them left the core
# plugins' configs (hydra/launcher/basic) out of the restored ConfigStore, for every later
# in-process compose of that pytest worker (1.3 executes its plugin modules again at each scan)
Plugins.instance()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tests first, longest first (``@pytest.mark.long(seconds=N)``, N as measured),
    the rest in their order: pytest-xdist's workers start them at once and share out the short
    ones beside them, instead of one worker meeting a 6-minute test at the end of its queue
    while the other has finished (the longest-first rule of scheduling)."""

    def seconds(item: pytest.Item) -> float:
        marker = item.get_closest_marker("long")
        return marker.kwargs.get("seconds", 60) if marker is not None else 0

    items.sort(key=lambda item: -seconds(item))  # (a stable sort: the others keep their order)


class Twin(nn.Module):
    """The toy network as ``online``, and a ``target`` of the same shape (momentum encoders)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.target = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.online(x)


class Score(Metric):
    """A metric no name rule knows: the mean of the first logit (its direction must be set)."""

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        self.total += float(preds[:, 0].sum())
        self.count += len(preds)

    def compute(self) -> float:
        return self.total / max(self.count, 1)


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300):
    """python -m expkit.train ARGS in a subprocess; returns CompletedProcess (+ .output: both streams)."""
    return run_module("expkit.train", *args, cwd=cwd, env=env, timeout=timeout)


def run_module(module: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 300):
    """python -m MODULE ARGS (an expkit command) in a subprocess, from the repo unless `cwd`;
    returns CompletedProcess (+ .output: both streams)."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]  # logs go to stdout, errors to stderr
    return proc


SLOW_HOOK = """
import time
from expkit import Hook

class Slow(Hook):
    def __init__(self, seconds):
        self.seconds = seconds

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        time.sleep(self.seconds)
"""


def slow_hook(tmp_path: Path, sleep_s: float = 0.05) -> Path:
    """Writes the ``slow`` hook (``hooks=[slow]``: every training iteration sleeps `sleep_s`) as a
    config group under `tmp_path`/conf, its module as `tmp_path`/slowhook.py; returns the config
    dir, for ``--config-dir``. A command that uses it needs `tmp_path` on PYTHONPATH."""
    conf = tmp_path / "conf" / "hooks"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "slow.yaml").write_text(f"slow:\n  _target_: slowhook.Slow\n  seconds: {sleep_s}\n")
    (tmp_path / "slowhook.py").write_text(SLOW_HOOK)
    return tmp_path / "conf"


def slow_train(tmp_path: Path, *args: str, sleep_s: float = 0.05) -> list[str]:
    """``python -m expkit.train hooks=[slow] ARGS``: every training iteration sleeps `sleep_s` (0.05:
    2 s an epoch of digits' 40 iterations), so that a signal or a time limit meets the run mid-epoch.
    The hook's module is written to `tmp_path`: run the command with ``slow_env(tmp_path)`` (or an
    environment of the test's own with `tmp_path` on PYTHONPATH). ``slow_train(tmp_path, "-m", ...)``
    is a sweep of slow jobs."""
    conf = slow_hook(tmp_path, sleep_s)
    return [sys.executable, "-m", "expkit.train", "--config-dir", str(conf), "hooks=[slow]", *args]


def sweep_train(*args: str) -> list[str]:
    """``python -m expkit.train -m ARGS``: a sweep's command line (give it ``hydra.sweep.dir=``),
    for a test that starts it itself (``subprocess.Popen``, its own environment); ``run_cli("-m",
    ...)`` runs one to its end."""
    return [sys.executable, "-m", "expkit.train", "-m", *args]


def search_worker(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """One worker of a search (``python -m expkit.train hparams_search=optuna ... ARGS``; ARGS may
    name ``hooks=[slow]``: 0.01 s an iteration), started in its own process group, its output in
    `tmp_path`/NAME.txt. Start several with the same ARGS for workers of one search; end them
    with ``finish_workers`` (and ``kill_workers`` in a ``finally:``). Returns (process, output file)."""
    conf = slow_hook(tmp_path, 0.01)
    out = tmp_path / f"{name}.txt"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HYDRA_FULL_ERROR": "0"}
    command = [sys.executable, "-m", "expkit.train", "--config-dir", str(conf), *args]
    with out.open("w") as sink:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc, out


def finish_workers(workers: list[tuple[subprocess.Popen, Path]], timeout: float = 400) -> None:
    """Waits for each of ``search_worker``'s `workers`: each must exit 0 (else its output's end is
    the failure). Any left running when this ends (a failure, a timeout) is killed."""
    try:
        for proc, out in workers:
            rc = proc.wait(timeout=timeout)
            assert rc == 0, f"{out.name} exited {rc}:\n{out.read_text()[-3000:]}"
    finally:
        kill_workers(workers)


def kill_workers(workers: list[tuple[subprocess.Popen, Path]]) -> None:
    """SIGKILLs the process group of each of ``search_worker``'s `workers` still running, and reaps it."""
    for proc, _ in workers:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def digit_shards_command(out: Path) -> subprocess.CompletedProcess:
    """``python -m expkit.shards out=OUT samples_per_shard=300``: the digits written as tar shards
    (5 for training); it must exit 0. Its last line is the train command it suggests."""
    proc = subprocess.run(
        [sys.executable, "-m", "expkit.shards", f"out={out}", "samples_per_shard=300"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def slow_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment ``slow_train``'s command needs (its hook's module on PYTHONPATH), one thread."""
    return {**os.environ, "PYTHONPATH": str(tmp_path), "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1", **extra}


def assert_same_weights(work: Path, reference: Path, name: str) -> None:
    """The checkpoint `name` of two work dirs holds bit-identical model weights."""
    final, expected = (torch.load(w / "checkpoints" / name, weights_only=True)["state_dict"] for w in (work, reference))
    assert final.keys() == expected.keys()
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{work.name}: {key} differs from {reference.name}'s"


def train_losses(work: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of every training record of a work dir's metrics.jsonl, in the file's order."""
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]


def torchrun_command(
    *args: str,
    nproc: int = 2,
    module: str | None = "expkit.train",
    launcher: tuple[str, ...] = (),
    standalone: bool = True,
) -> list[str]:
    """``torchrun --standalone --nproc_per_node=NPROC [LAUNCHER] -m MODULE ARGS`` as an argv
    (``module=None``: ARGS start with a script; ``standalone=False``: LAUNCHER gives the rendezvous,
    as for several nodes), for a test that starts the agents itself; ``torchrun`` runs one."""
    command = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else [])]
    command += [f"--nproc_per_node={nproc}", *launcher]
    return command + (["-m", module, *args] if module else list(args))


def torchrun(
    *args: str,
    cwd: Path,
    nproc: int = 2,
    module: str | None = "expkit.train",
    launcher: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: int = 300,
):
    """``torchrun --standalone --nproc_per_node=NPROC [LAUNCHER] -m MODULE ARGS`` in a subprocess
    (``module=None``: ARGS start with a script; ``torchrun_command``); one thread per process.
    Returns CompletedProcess (+ .output: both streams)."""
    command = torchrun_command(*args, nproc=nproc, module=module, launcher=launcher)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    proc = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    return proc


DIE_ONCE = '''
import os, signal
import torch.distributed as dist
from expkit import Hook

class DieOnce(Hook):
    """Rank 1 is SIGKILLed once, at iteration 25 (the last checkpoint: iteration 20)."""

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        marker = runner.work_dir / "died"
        if dist.get_rank() == 1 and runner.iter == 25 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
'''
"""A hook module (``diehook.py``, ``+hooks.die._target_=diehook.DieOnce``) for the elastic
restarts of the DDP, FSDP and multi-node tests: rank 1 SIGKILLed once, at iteration 25."""

SEEN_PROBE = '''
import hashlib, json, os
from expkit import Hook

class Seen(Hook):
    """Each trained sample's digest (its input's bytes), by epoch, appended per rank."""

    priority = "LOWEST"

    def after_train_iter(self, runner, *, batch_idx, data_batch, outputs):
        inputs = data_batch[0]
        rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in inputs]
        with open(runner.work_dir / f"seen{os.environ.get('RANK', '0')}.jsonl", "a") as f:
            f.write(json.dumps([runner.epoch, rows]) + "\\n")
'''
"""A hook module (``seenprobe.py``, ``+hooks.seen._target_=seenprobe.Seen``) that records every
trained sample per rank, read back by ``seen_samples`` (the world-size and shard tests)."""


def seen_samples(work: Path) -> Counter:
    """How often each sample of the first epoch was trained on, over every rank (``SEEN_PROBE``'s records)."""
    seen: Counter = Counter()
    for path in work.glob("seen*.jsonl"):
        for line in path.read_text().splitlines():
            epoch, rows = json.loads(line)
            if epoch == 0:
                seen.update(rows)
    return seen


@pytest.fixture
def recorder_log() -> list[str]:
    return []


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A real tmpfs of `size` at `path` (skips where mounting is not allowed), unmounted after."""
    path.mkdir()
    try:
        mounted = not subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
    except OSError:  # no mount program (Windows, minimal images)
        mounted = False
    if not mounted:
        pytest.skip("mounting a small tmpfs is not allowed here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


class S3:
    """A moto S3 server on 127.0.0.1 with IAM authentication on; one user whose keys may do
    anything, and one bucket, ``S3.BUCKET`` (the object-storage and shard tests). Needs moto's
    server and s3fs (the s3test extra).

    Args:
        tmp: a dir for the (absent) AWS config files the server's clients are pointed at.
    """

    BUCKET = "ckpts"

    def __init__(self, tmp: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # the first 3 requests (the user, its key, its policy) go unauthenticated, every later one is checked
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                break
            assert time.monotonic() < deadline and self.proc.poll() is None, "moto's server did not start"
            time.sleep(0.1)
        import boto3  # (moto's own dependency: the test's IAM setup only)

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        iam.put_user_policy(
            UserName="trainer",
            PolicyName="all",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
            ),
        )
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.env = {  # what a user exports for a bucket (AWS_ENDPOINT_URL: an S3-compatible store such as MinIO)
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none"),
        }
        self.fs().mkdir(self.BUCKET)

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, endpoint_url=self.endpoint, skip_instance_cache=True)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _pg_bin(name: str) -> str | None:
    """A PostgreSQL server program: on PATH, or where Debian's postgresql package puts it."""
    import shutil

    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    return str(versions[-1]) if versions else None


class PostgresServer:
    """A real PostgreSQL server on 127.0.0.1 in a data dir of its own (Debian's postgresql package:
    scripts/test.sh and .ci/run install it): ``url``, and ``stop()`` / ``start()`` for outages.

    Args:
        root: the server's dir (data, socket, log); made here.
    """

    def __init__(self, root: Path) -> None:
        import shutil
        import socket

        self.root, self.data = root, root / "data"
        self.initdb, self.pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # (initdb refuses root: the server runs as postgres)
            shutil.chown(root, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://expkit@127.0.0.1:{self.port}/postgres"
        init = [*self.as_user, self.initdb, "-D", str(self.data), "-A", "trust", "-U", "expkit"]
        subprocess.run(init, check=True, capture_output=True)

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        started = subprocess.run(
            [
                *self.as_user,
                self.pg_ctl,
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.root / "log"),
                "-w",
                "start",
            ],
            capture_output=True,
            text=True,
        )
        assert started.returncode == 0, started.stdout + started.stderr + (self.root / "log").read_text()

    def stop(self) -> None:
        """As a crash or a power cut does (``-m immediate``): every connection dropped at once."""
        subprocess.run(
            [*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"], capture_output=True
        )


@pytest.fixture
def postgres_server():
    """A started ``PostgresServer``, stopped and removed after the test. Without PostgreSQL the
    test skips (fails where CI sets EXPKIT_REQUIRE_POSTGRES=1)."""
    import shutil
    import tempfile

    if _pg_bin("initdb") is None or _pg_bin("pg_ctl") is None:
        if os.environ.get("EXPKIT_REQUIRE_POSTGRES"):
            pytest.fail("PostgreSQL's initdb/pg_ctl are not installed (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; scripts/test.sh does as root)")
    pytest.importorskip("psycopg", reason="the postgres extra: pip install -e '.[postgres]'")
    server = PostgresServer(Path(tempfile.mkdtemp(prefix="expkit-pg-")))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture
def postgres(postgres_server):
    """The URL of a real PostgreSQL server on 127.0.0.1 (``postgres_server``)."""
    return postgres_server.url


SVG_NS = "{http://www.w3.org/2000/svg}"
SVG_CHAR_EM = 0.6  # a character's estimated width in em (expkit.loggers.svgplot.CHAR_EM, read apart from it)


def _svg_text_box(text: ET.Element) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a <text>: its length x SVG_CHAR_EM em wide, placed by its
    text-anchor; from 0.8 em above its baseline to 0.2 em below; turned by a ``rotate(a cx cy)``."""
    x, y, size = float(text.get("x", 0)), float(text.get("y", 0)), float(text.get("font-size", 16))
    width = len(text.text or "") * SVG_CHAR_EM * size
    left = x - {"start": 0.0, "middle": width / 2, "end": width}[text.get("text-anchor", "start")]
    corners = [
        (left, y - 0.8 * size),
        (left + width, y - 0.8 * size),
        (left, y + 0.2 * size),
        (left + width, y + 0.2 * size),
    ]
    transform = (text.get("transform") or "").strip()
    if transform:
        angle, cx, cy = (float(v) for v in transform.removeprefix("rotate(").removesuffix(")").split())
        cos, sin = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        corners = [
            (cx + (px - cx) * cos - (py - cy) * sin, cy + (px - cx) * sin + (py - cy) * cos) for px, py in corners
        ]
    xs, ys = [c[0] for c in corners], [c[1] for c in corners]
    return min(xs), min(ys), max(xs), max(ys)


def assert_svg_reads_right(path: Path) -> dict[str, str]:
    """An SVG chart of expkit's reads right: no two texts' boxes (``_svg_text_box``) overlap, none
    reaches past the svg's width or height, and every series (its elements share a ``data-key``, or
    else a tooltip) has one color, the color of its legend entry where it has one.

    Returns:
        The color of each series, by its key.
    """
    root = ET.parse(path).getroot()
    width, height = float(root.get("width")), float(root.get("height"))
    boxes = [(t.text, _svg_text_box(t)) for t in root.iter(f"{SVG_NS}text") if (t.text or "").strip()]
    for text, (left, top, right, bottom) in boxes:
        assert left >= -0.5 and top >= -0.5 and right <= width + 0.5 and bottom <= height + 0.5, (
            f"{path.name}: {text!r} at ({left:.0f}, {top:.0f})-({right:.0f}, {bottom:.0f}) is cut by the "
            f"{width:.0f}x{height:.0f} svg"
        )
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        across = min(box_a[2], box_b[2]) - max(box_a[0], box_b[0])
        down = min(box_a[3], box_b[3]) - max(box_a[1], box_b[1])
        assert across <= 0.5 or down <= 0.5, f"{path.name}: {a!r} and {b!r} overlap ({across:.0f} x {down:.0f} px)"
    children = list(root)
    legend: dict[str, str] = {}
    for i, rect in enumerate(children):
        if rect.tag == f"{SVG_NS}rect" and rect.get("class") == "legend":
            label = children[i + 1]  # the entry's text follows its swatch
            tip = label.find(f"{SVG_NS}title")
            legend[rect.get("data-key") or (tip.text if tip is not None else label.text)] = rect.get("fill")
    colors: dict[str, set[str]] = {}
    for element in children:
        tip = element.find(f"{SVG_NS}title")
        if element.get("class") in ("series", "marker", "point", "errorbar") and (
            element.get("data-key") or tip is not None
        ):
            key = element.get("data-key") or tip.text
            color = element.get("fill") if element.tag == f"{SVG_NS}circle" else element.get("stroke")
            colors.setdefault(key, set()).add(color)
    for key, found in colors.items():
        assert len(found) == 1, f"{path.name}: {key!r} is drawn in several colors: {sorted(found)}"
        assert key not in legend or found == {legend[key]}, (
            f"{path.name}: {key!r} is drawn in {found.pop()}, its legend entry in {legend[key]}"
        )
    return {key: found.pop() for key, found in colors.items()} | legend
