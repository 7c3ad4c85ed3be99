"""No two of expkit's modules import each other, not even inside a function (issue 59): a cycle
means neither module can be read, moved or tested without the other. Found with grimp, the
import graph lint-imports checks the layers on (imports under `if TYPE_CHECKING:` are
annotations, not dependencies)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # (the repository: this file is tests/house/test_import_cycles.py)

needs_grimp = pytest.mark.skipif(sys.version_info < (3, 11), reason="import-linter (grimp) needs Python 3.11")

# cycles that are known and left to another change; each must still be one (else remove it here).
# None is left: export and predict read a restored run's inputs from expkit.config.model_inputs
KNOWN_CYCLES: list[set[str]] = []


def import_cycles(package: str = "expkit") -> list[str]:
    """Every cycle of imports among `package`'s modules, one line each: its modules, and where
    each of them imports the next (file and line)."""
    import grimp

    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    found = []
    for group in _strongly_connected(imports):
        where = [
            f"{d['importer']}:{d['line_number']} imports {d['imported']}"
            for a in sorted(group)
            for b in sorted(imports[a] & group)
            for d in graph.get_import_details(importer=a, imported=b)
        ]
        found.append(f"{' <-> '.join(sorted(group))} ({'; '.join(where)})")
    return sorted(found)


def _strongly_connected(imports: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more modules that each reach every other one of the group through
    imports (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []
    for start in sorted(imports):
        if start in index:
            continue
        work = [(start, iter(sorted(imports[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            module, pending = work[-1]
            following = next((m for m in pending if m not in index or m in stack), None)
            if following is not None and following not in index:
                index[following] = low[following] = len(index)
                stack.append(following)
                work.append((following, iter(sorted(imports[following]))))
                continue
            if following is not None:  # on the stack: a way back into the group being found
                low[module] = min(low[module], index[following])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = set(stack[stack.index(module) :])
                del stack[stack.index(module) :]
                if len(group) > 1:
                    groups.append(group)
    return groups


@needs_grimp
def test_no_two_modules_of_expkit_import_each_other():
    found = import_cycles()
    known = [line for line in found if any(set(line.split(" (")[0].split(" <-> ")) == c for c in KNOWN_CYCLES)]
    new = [line for line in found if line not in known]
    assert not new, "modules that import each other (move the shared piece down a layer):\n" + "\n".join(new)
    assert len(known) == len(KNOWN_CYCLES), f"a known cycle is gone: remove it from KNOWN_CYCLES; left: {known}"


@needs_grimp
def test_an_import_back_inside_a_function_is_found_as_a_cycle(tmp_path):
    shutil.copytree(ROOT / "expkit", tmp_path / "expkit", ignore=shutil.ignore_patterns("__pycache__"))
    # expkit.core.settings imports expkit.core.errors; now errors imports settings back, lazily
    with (tmp_path / "expkit" / "core" / "errors.py").open("a") as f:
        f.write("\n\ndef _late() -> None:\n    from expkit.core import settings  # noqa: F401 (a cycle, on purpose)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).parent}"}
    script = "import test_import_cycles as t; print('\\n'.join(t.import_cycles()))"
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "expkit.core.errors <-> expkit.core.settings (" in proc.stdout, proc.stdout
    assert "expkit.core.errors:" in proc.stdout and "imports expkit.core.settings" in proc.stdout, proc.stdout
