"""The documentation site builds strictly, and what its pages show works.

- ``mkdocs build --strict`` passes (a broken link, a missing anchor, a docstring mkdocstrings
  cannot render fail it) and the API reference is rendered.
- Every ```python block of docs/*.md runs: a page's blocks in order in one namespace, from a
  scratch directory (relative ``outputs/...`` paths land there), with ``max_epochs`` capped
  at 2; a ``test_*(tmp_path)`` function a block defines is called.
- Every ```yaml block parses.
- Every ``python -m expkit.<command>`` line of a ```bash block (docs/*.md and README.md)
  composes: it runs with ``--cfg job`` appended, so Hydra prints the config and runs
  nothing (``torchrun ... -m expkit.train ARGS`` is checked as ``python -m expkit.train ARGS``). A ``-m`` sweep is checked one job at a time, each value of every swept key at
  least once. Lines with ``--help`` or ``--cfg``, and ``expkit.sweep``, run as written.
- Every key of every shipped YAML file is on the page that documents its group, and every
  stage is on the hooks page.

Placeholders: ``outputs/runs/<...>`` becomes a real run dir and ``outputs/sweeps/<...>`` its
sweep dir (a 1-epoch, one-job sweep made once for this module); any other ``<...>`` in a
command fails the test. A ``cd examples/my_project`` line moves the lines after it in its
block there (with ``PYTHONPATH`` set to it); elsewhere ``--config-dir conf`` names an empty
directory of the scratch dir.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import REPO, sweep_train

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))  # docs/api/ holds no code, only ::: directives
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```[ \t]*$", flags=re.MULTILINE | re.DOTALL)
CHILD_ENV = {**os.environ, "HYDRA_FULL_ERROR": "0", "NO_MKDOCS_2_WARNING": "1"}


def _blocks(path: Path, lang: str) -> list[str]:
    return [body for found, body in FENCE.findall(path.read_text()) if found == lang]


def _pages_with(lang: str) -> list[Path]:
    return [page for page in PAGES if _blocks(page, lang)]


def _substitute(text: str, trained: SimpleNamespace) -> str:
    text = re.sub(r"outputs/runs/<[^>]*>", str(trained.run), text)
    return re.sub(r"outputs/sweeps/<[^>]*>", str(trained.sweep), text)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> SimpleNamespace:
    """A real one-job sweep of one epoch: its job dir is the run that placeholders name."""
    sweep = tmp_path_factory.mktemp("docs_run") / "sweep"
    proc = subprocess.run(
        sweep_train("trainer.max_epochs=1", f"hydra.sweep.dir={sweep}"),
        cwd=REPO,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (sweep / "0" / "result.json").is_file() and (sweep / "best.json").is_file()
    return SimpleNamespace(run=sweep / "0", sweep=sweep)


# -- the site -------------------------------------------------------------------------------


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.fail("mkdocs is not installed: run `bash scripts/setup.sh all` (the docs extra installs it)")
    site = tmp_path / "site"
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    for page in PAGES:
        built = site / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.is_file(), f"{page.name} is not in the built site (is it in mkdocs.yml's nav?)"
    runner_page = (site / "api" / "runner" / "index.html").read_text()
    assert 'id="expkit.Runner.run"' in runner_page, "mkdocstrings rendered no API reference for expkit.Runner"


# -- python and yaml blocks -----------------------------------------------------------------


def _cap_epochs(code: str) -> str:
    return re.sub(r"(max_epochs\s*=\s*)(\d+)", lambda m: f"{m.group(1)}{min(int(m.group(2)), 2)}", code)


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with("python"), ids=lambda page: page.name)
def test_python_blocks_run(page, trained, tmp_path, monkeypatch):
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    called: set[str] = set()
    for i, block in enumerate(_blocks(page, "python"), 1):
        code = _cap_epochs(_substitute(block, trained))
        exec(compile(code, f"{page.name}, python block {i}", "exec"), namespace)  # noqa: S102 - the page's own code
        for name, func in list(namespace.items()):
            if name.startswith("test_") and callable(func) and name not in called:
                called.add(name)
                func_tmp = tmp_path / name
                func_tmp.mkdir()
                func(**{"tmp_path": func_tmp} if "tmp_path" in inspect.signature(func).parameters else {})


def test_python_blocks_are_found():
    assert len(_pages_with("python")) >= 4, "the docs lost their Python examples, or the fence pattern broke"


@pytest.mark.parametrize("page", _pages_with("yaml"), ids=lambda page: page.name)
def test_yaml_blocks_parse(page):
    for i, block in enumerate(_blocks(page, "yaml"), 1):
        try:
            yaml.safe_load(block)
        except yaml.YAMLError as exc:
            pytest.fail(f"{page.name}, yaml block {i} does not parse: {exc}")


# -- command lines --------------------------------------------------------------------------

FLAGS_WITH_VALUE = {"--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp"}


@dataclass(frozen=True)
class Check:
    where: str  # page and line, for the failure message
    argv: tuple[str, ...]
    cwd: Path
    pythonpath: str | None = None


def _expkit_command(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(module, args) of `python -m expkit.X ARGS`, `torchrun ... -m expkit.X ARGS` or
    `expkit-X ARGS`; None for any other command."""
    program = Path(tokens[0]).name
    if program.startswith("expkit-"):
        return program.removeprefix("expkit-"), tokens[1:]
    if program in ("python", "python3", "torchrun") and "-m" in tokens:
        at = tokens.index("-m")
        if at + 1 < len(tokens) and tokens[at + 1].startswith("expkit."):
            return tokens[at + 1].removeprefix("expkit."), tokens[at + 2 :]
    return None


def _jobs(args: list[str]) -> list[list[str]]:
    """The argument lists that compose each value of a sweep: job i takes value i of every
    swept key (its last value once it has no more). A bare word (`expkit.compare`'s run dirs) is
    passed as it is, with the flags."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    flags: list[str] = []
    rest = iter(args)
    overrides: list[str] = []
    for arg in rest:
        if arg in FLAGS_WITH_VALUE:
            flags += [arg, next(rest)]
        elif arg.startswith("-") or "=" not in arg:
            flags.append(arg)
        else:
            overrides.append(arg)
    columns: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            columns.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            columns.append([override.input_line])
    jobs = max((len(column) for column in columns), default=1)
    return [flags + [column[min(i, len(column) - 1)] for column in columns] for i in range(jobs)]


def _command_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, line) with backslash continuations joined."""
    lines: list[tuple[int, str]] = []
    start, pending = None, ""
    for number, line in enumerate(body.split("\n"), first_line):
        start = number if start is None else start
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((start, pending + line))
        start, pending = None, ""
    return lines


def _checks(path: Path, trained: SimpleNamespace, scratch: Path) -> list[Check]:
    checks: list[Check] = []
    text = path.read_text()
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    for match in FENCE.finditer(text):
        if match.group(1) != "bash":
            continue
        cwd, pythonpath = scratch, None
        first_line = text.count("\n", 0, match.start(2)) + 1
        for number, line in _command_lines(_substitute(match.group(2), trained), first_line):
            where = f"{name}:{number}"
            tokens = shlex.split(line, comments=True)
            if tokens[:2] == ["cd", "examples/my_project"]:
                cwd = REPO / "examples" / "my_project"
                pythonpath = str(cwd)
                continue
            segments: list[list[str]] = [[]]
            for token in tokens:  # `a && b`: each command on its own
                if token == "&&":
                    segments.append([])
                else:
                    segments[-1].append(token)
            for segment in filter(None, segments):
                command = _expkit_command(segment)
                if command is None:
                    continue
                module, args = command
                placeholder = next((a for a in args if re.search(r"<[^>]+>", a)), None)
                assert placeholder is None, (
                    f"{where}: unknown placeholder in {placeholder!r}; see tests/house/test_docs.py"
                )
                base = (sys.executable, "-m", f"expkit.{module}")
                if module == "sweep" or any(a in ("--help", "-h") or a.startswith("--cfg") for a in args):
                    checks.append(Check(where, (*base, *args), cwd, pythonpath))  # runs nothing, or only reads
                    continue
                args = [a for a in args if a not in ("-m", "--multirun")]
                for job in _jobs(args):
                    checks.append(Check(where, (*base, *job, "--cfg", "job"), cwd, pythonpath))
    return checks


# Each check is the command's own module run as __main__ (as `python -m` does) with its argv;
# a driver process runs a batch of them one after another, so the batch pays Python's and
# torch's start-up (about 2 s) once. A check that fails there is run again alone in a
# fresh process, and only that verdict counts.
DRIVER = """
import contextlib, io, json, os, runpy, sys
from hydra.core.global_hydra import GlobalHydra
results = []
for argv, cwd, pythonpath in json.load(sys.stdin):
    os.chdir(cwd)
    sys.path[:0] = [pythonpath] if pythonpath else []
    output, code = io.StringIO(), 0  # what the command prints: only its exit code counts here
    sys.argv = [argv[0], *argv[2:]]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code = 1
    finally:
        GlobalHydra.instance().clear()
        if pythonpath:
            sys.path.remove(pythonpath)
    results.append(code)
sys.__stdout__.write("\\n@@RESULTS@@" + json.dumps(results))
"""


def _alone(check: Check) -> str | None:
    """None when the check passes in a fresh process of its own, else what it printed."""
    env = dict(CHILD_ENV)
    if check.pythonpath:
        env["PYTHONPATH"] = check.pythonpath
    proc = subprocess.run(check.argv, cwd=check.cwd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode == 0:
        return None
    shown = shlex.join(["python", *check.argv[1:]])
    return f"{check.where}: exit {proc.returncode}: {shown}\n{(proc.stdout + proc.stderr)[-1500:]}"


def _batch(checks: list[Check]) -> list[str]:
    """The failures among `checks`, run in one driver process (each failure confirmed alone)."""
    batch = [[[check.argv[0], *check.argv[2:]], str(check.cwd), check.pythonpath] for check in checks]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(batch),
        cwd=REPO,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "@@RESULTS@@" in proc.stdout, f"the driver process failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    codes = json.loads(proc.stdout.rsplit("@@RESULTS@@", 1)[1])
    return [failure for check, code in zip(checks, codes) if code != 0 and (failure := _alone(check))]


@pytest.mark.slow
def test_commands_compose(trained, tmp_path):
    scratch = tmp_path / "cwd"
    (scratch / "conf").mkdir(parents=True)  # `--config-dir conf` outside examples/my_project: an empty one
    checks: dict[tuple, Check] = {}
    for path in [*PAGES, REPO / "README.md"]:
        for check in _checks(path, trained, scratch):
            checks.setdefault((check.argv, check.cwd, check.pythonpath), check)  # each distinct command once
    assert len(checks) >= 40, f"only {len(checks)} commands found in the docs' bash blocks: did the parser break?"
    ordered = list(checks.values())
    with ThreadPoolExecutor(max_workers=2) as pool:  # two driver processes, one per core
        failures = [f for batch in pool.map(_batch, [ordered[0::2], ordered[1::2]]) for f in batch]
    assert not failures, f"{len(failures)} of {len(checks)} documented commands fail:\n\n" + "\n\n".join(failures)


def test_command_parsing(tmp_path):
    """The rules above, on made-up lines (so a parser that finds nothing cannot pass quietly)."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        ".venv/bin/python -m expkit.train -m optim.lr=0.1,0.01 model=mlp,cnn,resnet18 \\\n"
        "    'hooks=[ema]'   # a comment\n"
        "bash scripts/setup.sh && .venv/bin/python -m expkit.eval checkpoint=outputs/runs/<run>\n"
        ".venv/bin/torchrun --nproc_per_node=2 -m expkit.train --help\n"
        "cd examples/my_project\n"
        "python -m expkit.train --config-dir conf experiment=my_exp\n"
        ".venv/bin/tensorboard --logdir outputs/\n"
        "```\n"
    )
    trained = SimpleNamespace(run=Path("/r"), sweep=Path("/s"))
    checks = _checks(page, trained, tmp_path)
    argvs = [check.argv[1:] for check in checks]
    assert argvs == [
        ("-m", "expkit.train", "optim.lr=0.1", "model=mlp", "hooks=[ema]", "--cfg", "job"),
        ("-m", "expkit.train", "optim.lr=0.01", "model=cnn", "hooks=[ema]", "--cfg", "job"),
        ("-m", "expkit.train", "optim.lr=0.01", "model=resnet18", "hooks=[ema]", "--cfg", "job"),
        ("-m", "expkit.eval", "checkpoint=/r", "--cfg", "job"),
        ("-m", "expkit.train", "--help"),
        ("-m", "expkit.train", "--config-dir", "conf", "experiment=my_exp", "--cfg", "job"),
    ]
    assert [check.where.rsplit(":", 1)[1] for check in checks] == ["2", "2", "2", "4", "5", "7"]
    assert checks[-1].cwd == REPO / "examples" / "my_project" and checks[0].cwd == tmp_path
    page.write_text("```bash\npython -m expkit.predict input=<file>\n```\n")
    with pytest.raises(AssertionError, match="unknown placeholder"):
        _checks(page, trained, tmp_path)


# -- coverage of the config tree and the stages ---------------------------------------------

CONF = REPO / "expkit" / "conf"
SKIPPED_KEYS = {"defaults", "_target_", "_partial_"}
COMMAND_PAGES = {
    "eval.yaml": "evaluation.md",
    "predict.yaml": "using-the-model.md",
    "export.yaml": "using-the-model.md",
    "sweep.yaml": "sweeps.md",
    "check.yaml": "check.md",
    "shards.yaml": "data-at-scale.md",
    "compare.yaml": "compare.md",
    "lr_find.yaml": "lr-find.md",
    "report.yaml": "sweeps.md",
    "dashboard.yaml": "sweeps.md",
    "reproduce.yaml": "checkpoints.md",
}
SKIPPED_PATHS = ("hydra.job_logging", "hydra.help", "hydra.sweeper.params.")  # Hydra's own; the search space


def _group_page(relative: Path) -> str | None:
    """The page that documents a YAML file's keys; None for files that only set other groups' keys."""
    top = relative.parts[0]
    if top in ("experiment", "hydra_defaults"):
        return None
    if top in ("default_hooks", "hooks"):
        return "hooks.md"
    return COMMAND_PAGES.get(str(relative), "configuration.md")


def _leaf_keys(node: object, prefix: str = "") -> list[str]:
    """Dotted paths of the keys that hold a value (a dict whose keys are all skipped counts as one)."""
    found: list[str] = []
    for key, value in node.items() if isinstance(node, dict) else ():
        path = f"{prefix}{key}"
        if key in SKIPPED_KEYS or path.startswith(SKIPPED_PATHS):
            continue
        below = _leaf_keys(value, path + ".")
        found += below or [path]
    return found


def _documented(key: str, text: str) -> bool:
    """`key` appears in a code span, alone or as the last part of a dotted path (`hooks.ema.momentum`)."""
    leaf = re.escape(key.rsplit(".", 1)[-1])
    return re.search(rf"`(?:[\w/+~.]*\.)?{leaf}(?:=[^`]*)?`", text) is not None


def test_every_config_key_is_documented():
    missing = []
    for path in sorted(CONF.rglob("*.yaml")):
        relative = path.relative_to(CONF)
        page = _group_page(relative)
        if page is None:
            continue
        text = (DOCS / page).read_text()
        for key in _leaf_keys(yaml.safe_load(path.read_text()) or {}):
            if not _documented(key, text):
                missing.append(f"{relative}: {key} (on docs/{page})")
    assert not missing, "config keys the docs do not mention:\n" + "\n".join(missing)


def test_every_stage_is_documented():
    from expkit import Stage

    text = (DOCS / "hooks.md").read_text()
    missing = [stage.value for stage in Stage if f"| `{stage.value}` |" not in text]
    assert not missing, f"stages missing from the table in docs/hooks.md: {missing}"
