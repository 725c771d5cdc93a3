"""A user who installs the package rather than the checkout: a wheel in a fresh virtual environment has
every device profile and the default recipe, and builds from any directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_recipe

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parent.parent


def _run(*command: str | Path, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    run = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{command}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the venv's `edgetune` command, a directory outside the checkout) after `pip install <wheel>`."""
    root = tmp_path_factory.mktemp("install")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", root / "dist", REPOSITORY, cwd=root)
    wheels = list((root / "dist").glob("edgetune-*.whl"))
    assert len(wheels) == 1, wheels
    # the dependencies come from this interpreter's site (installed from the same pyproject.toml by scripts/test;
    # a fresh environment downloads them again: 35 s); the venv's own site-packages, holding the wheel, comes first
    _run(sys.executable, "-m", "venv", "--system-site-packages", root / "venv", cwd=root)
    _run(root / "venv" / "bin" / "python", "-m", "pip", "install", "-q", wheels[0], cwd=root)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return root / "venv" / "bin" / "edgetune", elsewhere


def test_the_wheel_lists_every_device_profile(installed) -> None:
    edgetune, elsewhere = installed
    listed = _run(edgetune, "targets", cwd=elsewhere).stdout
    for profile in sorted((REPOSITORY / "edgetune" / "device_profiles").glob("*.yaml")):
        assert profile.stem in listed


def test_the_wheel_validates_and_builds_a_recipe_outside_the_checkout(installed) -> None:
    edgetune, elsewhere = installed
    recipe = write_tiny_recipe(elsewhere, trials=0)
    assert "ok (1 targets: host)" in _run(edgetune, "validate", recipe.name, cwd=elsewhere).stdout
    _run(edgetune, "build", recipe.name, cwd=elsewhere)
    assert (elsewhere / "out" / "tiny" / "host.tar.gz").is_file()
    # The installed package runs, not the checkout's sources.
    where = _run(edgetune.parent / "python", "-c", "import edgetune; print(edgetune.__file__)", cwd=elsewhere)
    assert str(REPOSITORY) not in where.stdout


def test_the_default_recipe_is_the_repositorys_host_recipe() -> None:
    import yaml

    embedded = yaml.safe_load((REPOSITORY / "edgetune" / "default_recipe.yaml").read_text())
    checkout = yaml.safe_load((REPOSITORY / "recipes" / "host.yaml").read_text())
    assert embedded.pop("output") == "build" and checkout.pop("output") == "../build"
    assert embedded == checkout
