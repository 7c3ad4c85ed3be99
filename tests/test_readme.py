"""The README's code runs as written (work dirs redirected to tmp_path)."""

from __future__ import annotations

import re

from conftest import REPO


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)


def test_readme_python_examples_run(tmp_path, capsys):
    blocks = _python_blocks()
    assert len(blocks) == 2
    hook_block, runner_block = blocks
    namespace: dict = {}
    exec(hook_block, namespace)  # noqa: S102 - the README's hook example defines a class
    from expkit import Hook

    assert issubclass(namespace["PrintLoss"], Hook)
    runner_block = runner_block.replace('"outputs/notebook"', repr(str(tmp_path / "nb")))
    runner_block = runner_block.replace("max_epochs=5", "max_epochs=2")
    exec(runner_block, namespace)  # noqa: S102
    assert namespace["result"]["status"] == "completed"
    assert (tmp_path / "nb" / "result.json").is_file()
    assert "val/acc" in capsys.readouterr().out


def test_readme_commands_name_real_scripts():
    text = (REPO / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m expkit.train" in text
    assert "bash scripts/test.sh" in text
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()
