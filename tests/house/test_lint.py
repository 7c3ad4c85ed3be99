"""ruff (lint and format, settings in pyproject.toml) passes on the whole repository, and the
import layers in pyproject.toml hold (import-linter)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # (the repository: this file is tests/house/test_lint.py)


def _tool(name: str, extra: str) -> str:
    """The venv's `name` (pinned in constraints.txt), else one on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/setup.sh all` (the {extra} extra installs it)")
    return found


def _ruff() -> list[str]:
    return [_tool("ruff", "dev")]


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
        if (ROOT / name).is_file() and name != "tests/house/test_lint.py"  # (this file names the markers)
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1)
        if "# fmt: skip" in line or "# fmt: off" in line
    ]
    without_reason = [s for s in skips if not s.split("# fmt: ", 1)[1].split(None, 1)[1:]]
    assert len(skips) <= 5 and not without_reason, "\n".join(skips)


# -- the layers (pyproject.toml's [tool.importlinter]; CONTRIBUTING.md, "The layout") ------------
needs_import_linter = pytest.mark.skipif(sys.version_info < (3, 11), reason="import-linter needs Python 3.11")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the expkit in cwd, not the installed one
    return subprocess.run(
        [_tool("lint-imports", "lint"), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True
    )


def _layers() -> list[str]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return contracts[0]["layers"]  # (the layers; the others keep hydra_plugins beside the sweeps layer)


@needs_import_linter
def test_no_module_imports_from_a_layer_above_its_own():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, f"lint-imports (pyproject.toml's layers) failed:\n{proc.stdout[-4000:]}{proc.stderr}"
    assert "3 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


@needs_import_linter
def test_every_module_of_the_package_is_in_one_layer():
    """A new module outside every layer would go unchecked."""
    named = [name.strip() for layer in _layers() for name in layer.split(":")]
    package = ROOT / "expkit"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert len(named) == len(set(named)), "a module is named in two layers"
    assert set(named) == modules, (
        f"in no layer: {sorted(modules - set(named))}; no such module: {sorted(set(named) - modules)}"
    )


@needs_import_linter
def test_an_import_from_a_lower_layer_to_a_command_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "expkit", tmp_path / "expkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / "expkit" / "core" / "atomic.py").open("a") as f:
        f.write("\nimport expkit.train  # noqa: E402 (upward, on purpose)\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "expkit.core is not allowed to import expkit.train" in proc.stdout, proc.stdout[-2000:]
    assert "- expkit.core.atomic -> expkit.train" in proc.stdout, proc.stdout[-2000:]


# -- the public API: __all__ in every module ------------------------------------------------------
def _bound_and_public(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Every name a module binds at its top level (ifs and trys included), and the public
    functions and classes it defines there."""
    bound: set[str] = set()
    public: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if not node.name.startswith("_") and node in tree.body:
                public.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                bound.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            stack.extend([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)
    return bound, public


def test_every_module_says_what_it_exports_and_exports_its_public_functions_and_classes():
    """`__all__` names what `from module import *` and the API pages take: it must exist in
    every module, name only what the module binds, and hold every public function and class
    the module defines (a helper meant to stay inside starts with `_`)."""
    problems = []
    for path in sorted([*(ROOT / "expkit").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        declared = [
            node.value
            for node in tree.body
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        name = path.relative_to(ROOT)
        if not declared:
            problems.append(f"{name}: no __all__")
            continue
        listed = set(ast.literal_eval(declared[0]))
        bound, public = _bound_and_public(tree)
        if listed - bound:
            problems.append(f"{name}: __all__ names what the module does not bind: {sorted(listed - bound)}")
        if public - listed:
            problems.append(
                f"{name}: public but not in __all__ (add it, or start its name with _): {sorted(public - listed)}"
            )
    assert not problems, "\n".join(problems)


# every module: what users import (the commands' Python entry points, what configs name, the tasks,
# the pytest helper) and the subpackages' modules, which hooks and contributors call
DOCUMENTED = sorted((ROOT / "expkit").rglob("*.py")) + sorted((ROOT / "hydra_plugins").rglob("*.py"))


def test_every_public_function_and_class_documents_its_arguments():
    missing = []
    for path in DOCUMENTED:
        tree = ast.parse(path.read_text())
        declared = [
            n
            for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
        ]
        listed = set(ast.literal_eval(declared[0].value)) if declared else set()
        for node in tree.body:
            init = next((n for n in getattr(node, "body", ()) if getattr(n, "name", "") == "__init__"), None)
            if isinstance(node, ast.ClassDef) and node.name in listed and isinstance(init, ast.FunctionDef):
                arguments = [a.arg for a in (*init.args.args, *init.args.kwonlyargs) if a.arg != "self"]
                doc = (ast.get_docstring(node) or "") + (ast.get_docstring(init) or "")
                if arguments and "Args:" not in doc:  # (the constructor's, in the class's docstring)
                    missing.append(f"{path.relative_to(ROOT)}: class {node.name} has no Args: section")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in listed:
                arguments = [a.arg for a in (*node.args.args, *node.args.kwonlyargs) if a.arg not in ("self", "cls")]
                doc = ast.get_docstring(node) or ""
                if arguments and "Args:" not in doc:
                    missing.append(f"{path.relative_to(ROOT)}: {node.name}() has no Args: section")
                if isinstance(node.returns, ast.Constant) and node.returns.value is None:
                    continue
                if node.returns is not None and "Returns:" not in doc and "Yields:" not in doc:
                    missing.append(f"{path.relative_to(ROOT)}: {node.name}() returns something and has no Returns:")
    assert not missing, "\n".join(missing)


# -- every function in view: no body over 80 lines (ruff's C901 and PLR0915 count branches and
# statements, not lines) ----------------------------------------------------------------------------
MAX_BODY_LINES = 80


def _long_functions(source: str, name: str) -> list[str]:
    """`name:line function (N lines)` for every function in `source` whose body is longer than
    MAX_BODY_LINES: from its first statement after the docstring to its last line, blank lines
    and comments included (what a reader scrolls through)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
        lines = node.end_lineno - body[0].lineno + 1 if body else 0
        if lines > MAX_BODY_LINES:
            found.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_body_is_longer_than_80_lines():
    too_long = [
        found
        for path in sorted([*(ROOT / "expkit").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])
        for found in _long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not too_long, f"split these into functions that each do one thing (at most {MAX_BODY_LINES} lines):\n" + (
        "\n".join(too_long)
    )


def test_the_function_length_rule_counts_the_body_without_its_docstring():
    def function(body_lines: int) -> str:
        return 'def f():\n    """Its docstring,\n    on two lines."""\n' + "    x = 1\n" * body_lines

    assert _long_functions(function(80), "m.py") == []
    assert _long_functions(function(81), "m.py") == ["m.py:1 f (81 lines)"]
    nested = "class C:\n    def g(self):\n" + "        y = 2\n" * 81
    assert _long_functions(nested, "m.py") == ["m.py:2 g (81 lines)"]
