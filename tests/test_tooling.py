"""The house rules, checked by the test suite so CI enforces them: the strict type
check (which also checks the type-only tests in typecheck_api.py), the linter, and
the public surface."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

import purepp
import purepp.effects

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


# The project's own code: the checks read these folders only, so a file of the
# developer's own beside them (a runner, a scratch script) never fails the suite.
CODE_FOLDERS = ("purepp", "tests", "benchmarks", "tools", "typings")


def test_mypy_strict_is_clean() -> None:
    result = _run(sys.executable, "-m", "mypy", "--strict", "purepp", "tests", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_is_clean() -> None:
    # Through this interpreter, so a missing ruff fails instead of skipping.
    check = _run(sys.executable, "-m", "ruff", "check", *CODE_FOLDERS)
    assert check.returncode == 0, check.stdout + check.stderr
    formatted = _run(sys.executable, "-m", "ruff", "format", "--check", *CODE_FOLDERS)
    assert formatted.returncode == 0, formatted.stdout


def test_the_checks_read_every_tracked_python_file() -> None:
    listed = _run("git", "ls-files", "*.py", "*.pyi")
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    outside = [path for path in listed.stdout.split() if path.split("/", 1)[0] not in CODE_FOLDERS]
    assert not outside, f"tracked Python files outside {CODE_FOLDERS}: {outside}"


@pytest.mark.parametrize("module", [purepp, purepp.effects])
def test_public_names_exist_and_are_documented(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert len(set(names)) == len(names)
    for name in names:
        value = getattr(module, name)
        if callable(value):
            assert value.__doc__, f"{name} has no docstring"


def test_package_is_typed() -> None:
    assert (Path(purepp.__file__).parent / "py.typed").exists()


def test_only_purepp_is_installed_with_its_py_typed() -> None:
    # What `pip install .` puts beside a user's code: purepp and its py.typed, never the
    # repository's narrow torch stubs (typings/), which would shadow torch's own types.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = config["packages"]["find"]["include"]
    top_level = {path.name for path in ROOT.iterdir() if path.name.isidentifier()}
    installed = {name for name in top_level if any(fnmatch(name, p) for p in include)}
    assert installed == {"purepp"}, installed
    assert "typings" in top_level
    assert any(fnmatch("purepp.effects", p) for p in include)
    assert "py.typed" in config["package-data"]["purepp"]


def test_importing_the_pure_core_does_not_import_torch() -> None:
    code = "import sys, purepp, purepp.relay, purepp.dp; print('torch' in sys.modules)"
    result = _run(sys.executable, "-c", code)
    assert result.stdout.strip() == "False"
