"""The command line as a user meets it: exit codes, located errors, nothing written on bad input."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def edgetune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_validate_accepts_the_shipped_recipes_without_devices() -> None:
    for recipe in ("recipes/host.yaml", "recipes/fleet.yaml"):
        run = edgetune("validate", recipe, cwd=REPO)
        assert run.returncode == 0, run.stderr
        assert "ok" in run.stdout


def test_targets_lists_the_device_profiles() -> None:
    run = edgetune("targets", cwd=REPO)
    assert run.returncode == 0, run.stderr
    for name in ("host", "raspberry-pi-4", "cortex-a53", "jetson-orin", "mali-g76", "adreno-640", "a100", "h100",
                 "x86-server"):
        assert name in run.stdout


def test_bad_recipe_exits_2_with_located_errors_and_writes_nothing(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        "name: bad\n"
        "model:\n"
        "  zoo: tiny_cnn\n"
        "fleet:\n"
        "  - name: host\n"
        "    profle: host\n"
        "tuning:\n"
        "  trials_per_task: -1\n"
        "output: out\n"
    )
    run = edgetune("build", "bad.yaml", cwd=tmp_path)
    assert run.returncode == 2
    assert "bad.yaml:6: fleet[0].profle" in run.stderr and "did you mean 'profile'" in run.stderr
    assert "bad.yaml:8: tuning.trials_per_task" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_unknown_target_name_is_bad_input(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {zoo: tiny_cnn}\nfleet: [{name: host, profile: host}]\n"
                      "tuning: {trials_per_task: 1}\noutput: out\n")
    run = edgetune("build", "r.yaml", "--target", "rpi9", cwd=tmp_path)
    assert run.returncode == 2
    assert "rpi9" in run.stderr and "host" in run.stderr
    assert not (tmp_path / "out").exists()


def test_missing_recipe_file_is_bad_input(tmp_path: Path) -> None:
    run = edgetune("validate", "nope.yaml", cwd=tmp_path)
    assert run.returncode == 2
    assert "nope.yaml" in run.stderr


def test_progress_counts_trials_against_a_trial_count_only_where_the_recipe_gave_one() -> None:
    """The default recipe gives a time budget and no trial count: its progress said "16/1000000 trials"."""
    from edgetune.tuning.tune import UNBOUNDED_TRIALS, TaskProgress

    budgeted = TaskProgress(1, 34, "fused_conv2d", 16, UNBOUNDED_TRIALS, 83.0, 12.0, 600.0)
    counted = TaskProgress(1, 34, "fused_conv2d", 16, 64, 83.0, 12.0, None)
    assert budgeted.trials_text == "16 trials" and counted.trials_text == "16/64 trials"


def test_a_build_bounded_by_its_budget_alone_says_the_budgets_rest_is_left() -> None:
    """Without a trial count the budget ends the tuning: a 60-minute build's first pass said "~13 s left" after 58 s
    (its 14 tasks' pace over 16). With a trial count the tasks' pace estimates the rest, the budget capping it."""
    from edgetune.tuning.tune import UNBOUNDED_TRIALS, TaskProgress

    first_pass = TaskProgress(14, 16, "mean1", 8, UNBOUNDED_TRIALS, 8.7, 58.0, 3578.0)
    assert first_pass.seconds_left() == 3520.0
    assert TaskProgress(14, 16, "mean1", 8, UNBOUNDED_TRIALS, 8.7, 3600.0, 3578.0).seconds_left() == 0.0
    counted = TaskProgress(2, 4, "conv", 32, 64, 80.0, 30.0, None)  # 1.5 of 4 tasks in 30 s: 50 s more
    assert counted.tasks_done == 1.5 and counted.seconds_left() == 50.0
    assert TaskProgress(2, 4, "conv", 32, 64, 80.0, 30.0, 40.0).seconds_left() == 10.0  # the budget caps it
    assert TaskProgress(1, 4, "conv", 0, 64, None, 0.0, None).seconds_left() is None  # no pace yet


def test_on_a_terminal_a_build_bounded_by_its_budget_alone_fills_its_bar_with_the_budgets_time() -> None:
    """The bar's own estimate of what is left extrapolates its fill: filled by tasks, a budget-bound build's bar
    was nearly full after its first pass. Filled by time, it ends with the budget; with a trial count, by tasks."""
    import io

    from rich.console import Console

    from edgetune.build.context import Event
    from edgetune.cli import _ProgressView
    from edgetune.tuning.tune import UNBOUNDED_TRIALS, TaskProgress

    console = Console(file=io.StringIO(), force_terminal=True)
    with _ProgressView(console) as view:
        view(Event("host", "", TaskProgress(14, 16, "mean1", 8, UNBOUNDED_TRIALS, 8.7, 58.0, 3578.0)))
        view(Event("board", "", TaskProgress(2, 4, "conv", 32, 64, 80.0, 30.0, None)))
        budgeted, counted = view.progress.tasks
    assert (budgeted.total, budgeted.completed) == (3578.0, 58.0)
    assert (counted.total, counted.completed) == (4, 1.5)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed: nothing to keep out")
def test_commands_without_a_torch_model_import_tvm_but_never_pytorch() -> None:
    """TVM imports PyTorch whenever it can (2 s of every command): only a torch.export recipe needs it."""
    for args in (["targets"], ["validate", "recipes/host.yaml"], ["records", "check", "recipes/host.yaml"]):
        run = subprocess.run([sys.executable, "-X", "importtime", "-m", "edgetune", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode in (0, 1), run.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "tvm" in imported and "torch._C" not in imported, args  # a refused import is listed, its parts not
