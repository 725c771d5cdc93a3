"""Shared fixtures: one real tiny build per test session, reused by every test that only reads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TINY_RECIPE = """\
name: tiny
model:
  zoo: tiny_cnn
fleet:
  - name: host
    profile: host
tuning:
  trials_per_task: {trials}
  max_tasks: {max_tasks}
  seed: 1
output: out
"""


def run_edgetune(*args: str, cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """The installed command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "edgetune", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def write_tiny_recipe(directory: Path, trials: int = 2, max_tasks: int = 2) -> Path:
    path = directory / "tiny.yaml"
    path.write_text(TINY_RECIPE.format(trials=trials, max_tasks=max_tasks))
    return path


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """tiny_cnn built for this machine with 2 trials for each of its 2 heaviest tasks."""
    directory = tmp_path_factory.mktemp("tiny")
    write_tiny_recipe(directory)
    run = run_edgetune("build", "tiny.yaml", "--json", "summary.json", cwd=directory)
    assert run.returncode == 0, run.stdout + run.stderr
    return directory, run
