"""The README's embedding example runs as written and type-checks under mypy --strict."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tests" / "readme_example.py"


def _readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_example_is_the_checked_file() -> None:
    # The first python block is tests/readme_example.py without its docstring line.
    body = EXAMPLE.read_text().split("\n", 2)[2]
    assert _readme_python_blocks()[0] == body


@pytest.mark.multiprocess  # two gloo stages
def test_readme_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    # Stage 1 sampled at steps 0 and 1; stage 0 consumed them two steps later, and both
    # stages agreed the same shape over their group.
    lines = result.stdout.splitlines()
    assert "step 2: stage 0 got [100, 200] from step 0" in lines
    assert "step 3: stage 0 got [101, 201] from step 1" in lines
    assert any(line.startswith("both stages agreed BatchExecutionDescriptor(") for line in lines)


def test_readme_example_type_checks() -> None:
    # The project's strict configuration (pyproject.toml) applies to the example as written.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_readme_python_block_type_checks(tmp_path: Path) -> None:
    # Strict, but a snippet may leave its own helpers unannotated: what is checked is that
    # every name it imports is exported where it imports it from, and used as typed.
    scripts = []
    for index, block in enumerate(_readme_python_blocks()):
        scripts.append(tmp_path / f"block{index}.py")
        scripts[-1].write_text(block)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--allow-untyped-defs", "--allow-untyped-calls"]
        + [str(script) for script in scripts],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.multiprocess  # the first block starts two gloo stages
def test_every_readme_python_block_runs(tmp_path: Path) -> None:
    for index, block in enumerate(_readme_python_blocks()):
        script = tmp_path / f"block{index}.py"
        script.write_text(block)
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, f"README python block {index}:\n{result.stderr}"


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(
        r"<!-- test-command -->\n```\n(.*?)\n```\n<!-- /test-command -->", readme, re.S
    )
    assert block is not None
    assert "pytest" in block.group(1)
    assert "sed -n '/<!-- test-command -->/" in (ROOT / ".ci" / "run").read_text()
