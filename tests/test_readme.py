"""The README's embedding example runs as written and type-checks under mypy --strict; claims
the README makes that no other test states are pinned here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from purepp.effects.log import replay
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.errors import InterpreterError
from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

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
    # Strict, as a user's project checks what it copies: every name a snippet imports is
    # exported where it imports it from and used as typed, and its own helpers annotated.
    scripts = []
    for index, block in enumerate(_readme_python_blocks()):
        scripts.append(tmp_path / f"block{index}.py")
        scripts[-1].write_text(block)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict"] + [str(script) for script in scripts],
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


def test_replay_into_a_numpy_interpreter_stops_where_the_readme_says() -> None:
    # "A log holds no caller tensors: with none bound, a numpy or torch interpreter stops
    # with an InterpreterError at the first relay input, unbound." and "A lone
    # NumpyInterpreter stops at the first collective with another rank"
    receiver, sender = record_scripted_logs(
        make_schedule(ScheduleConfig(pp=2, dp=1, spec=1, steps=6, seed=0))
    )
    with pytest.raises(InterpreterError, match=r"buffer 'relay\.input\.\w+' is not bound"):
        replay(sender, NumpyInterpreter(rank=1))
    with pytest.raises(InterpreterError, match=r"broadcast from rank 1 in the lone interpreter"):
        replay(receiver, NumpyInterpreter(rank=0))


_SAMPLED_TYPES = """
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from purepp.effects.io import NumpyIO
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.rank import Agreed, RankConfig, RankDriver, Sampled


def finish(config: RankConfig, agreed: Agreed) -> None:
    interpreter = NumpyInterpreter()
    driver = RankDriver(config, interpreter, NumpyIO(interpreter))
    tokens = np.zeros((2, 1), dtype=np.int64)
    counts = np.ones(2, dtype=np.int32)
    own = Sampled(tokens=tokens, num_sampled=counts, num_rejected=counts)
    driver.finish(agreed, own)
    typed = Sampled[npt.NDArray[Any]](tokens=tokens, num_sampled=counts, num_rejected=counts)
    driver.finish(agreed, typed)
    driver.finish(agreed, Sampled(tokens=tokens, num_sampled=counts, num_rejected=counts))
    ones = torch.ones(2, dtype=torch.int32)
    big = torch.zeros(2, 1, dtype=torch.int64)
    tensors = Sampled(tokens=big, num_sampled=ones, num_rejected=ones)
    driver.finish(agreed, tensors)  # refused
"""


def test_a_numpy_sampled_of_its_own_is_taken_by_finish_and_torch_tensors_are_not(
    tmp_path: Path,
) -> None:
    # The README's typing note: a `Sampled(...)` of numpy arrays assigned to a variable of
    # its own is `Sampled[object]`, which `finish` takes; a `Sampled` of torch tensors to
    # a `RankDriver` over `NumpyIO` is still refused.
    script = tmp_path / "sampled_types.py"
    script.write_text(_SAMPLED_TYPES)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, result.stdout + result.stderr
    refused = _SAMPLED_TYPES.splitlines().index("    driver.finish(agreed, tensors)  # refused") + 1
    assert f':{refused}: error: Argument 2 to "finish" of "RankDriver"' in errors[0]
    assert '"Sampled[Tensor]"' in errors[0]
