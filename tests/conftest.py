"""Shared fixtures: one real tiny build per test run (shared by its xdist workers), reused by every test that only reads it."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from edgetune.frontend.onnx import LoadedModel


LONG_MODULES = ("test_release.py", "test_fleet.py", "test_emulated_boards.py", "test_real_models.py",
                "test_build.py", "test_selection.py", "test_transfer.py", "test_task_shards.py", "test_cross.py")
"""The modules that take minutes, longest first (about 230, 220, 180, 150, 110, 100, 80, 60 and 50 s alone):
`scripts/test`'s two workers take whole modules in this order, so neither is left with a long one at the end."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--part", choices=("all", "parallel", "serial"), default="all",
                     help="parallel: leave out the tests marked serial; serial: run only those (scripts/test runs "
                          "the first on two workers, then the second alone)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the chosen part, then put the long modules first (a stable sort: each module keeps its order)."""
    part = config.getoption("--part")
    if part != "all":
        kept: list[pytest.Item] = []
        left_out: list[pytest.Item] = []
        for item in items:
            (kept if (item.get_closest_marker("serial") is not None) == (part == "serial") else left_out).append(item)
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
    rank = {name: position for position, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_MODULES)))


def save_image_model(path: Path, name: str, nodes: list, data_shape: list[int], classes: int,
                     initializers: list) -> LoadedModel:
    """An ONNX graph from `data` (float32, `data_shape`) to `logits` (1 x classes), saved and loaded."""
    import onnx
    from onnx import TensorProto, helper

    from edgetune.frontend.onnx import load_model

    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape)],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])],
                              initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return load_model(zoo=None, onnx_path=path, input_shapes=None)


TINY_RECIPE = """\
name: tiny
model:
  zoo: tiny_cnn
fleet:
  - name: host
    profile: host
tuning:
  trials_per_task: {trials}{budget}
  max_tasks: {max_tasks}
  seed: 1{lean_tuning}
output: out{lean_package}
"""
LEAN_TUNING = "\n  in_model_candidates: 1"
LEAN_PACKAGE = "\npackage:\n  thread_wait: spin"
"""A lean tiny build: the tuner's best packaged and the model timed one way (6 of a tiny build's 15 s here).
The session's tiny build keeps the defaults: its tests check the in-model comparison and the threads' wait."""


def main_constants(mod) -> list:
    """The tensor constants of a relax module's `main`, as numpy arrays, in the order its visit meets them."""
    import tvm
    from tvm import relax

    constants: list = []
    relax.analysis.post_order_visit(mod["main"], lambda e: constants.append(e.value.numpy()) if isinstance(
        e, tvm.ir.GenericConst) and hasattr(e.value, "numpy") else None)
    return constants


def tiny_build_inputs(directory: Path) -> tuple:
    """The `tiny_build` fixture's model (loaded), its relax module, its target and its record store."""
    from edgetune.frontend.onnx import load_model, to_relax
    from edgetune.pipeline import record_locations
    from edgetune.profiles import resolve_profile
    from edgetune.recipe import load_recipe
    from edgetune.tuning.database.store import RecordStore

    recipe = load_recipe(directory / "tiny.yaml")
    target = resolve_profile(recipe.fleet[0].profile, None).tvm_target()
    store = RecordStore(record_locations(recipe)[recipe.fleet[0].name].directory)
    model = load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None)
    return model, to_relax(model), target, store


def library_outputs(library: Path, model):
    """What an exported library computes on the model's sample inputs, on this machine's CPU."""
    import tvm
    from tvm import relax

    machine = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    sample = model.sample_inputs()
    return machine["main"](*[tvm.runtime.tensor(sample[i.name]) for i in model.inputs]).numpy()


def run_edgetune(*args: str, cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """The installed command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "edgetune", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def write_tiny_recipe(directory: Path, trials: int = 2, max_tasks: int = 2, budget_min: float | None = None,
                      lean: bool = True) -> Path:
    path = directory / "tiny.yaml"
    budget = f"\n  time_budget_min: {budget_min}" if budget_min else ""
    path.write_text(TINY_RECIPE.format(trials=trials, max_tasks=max_tasks, budget=budget,
                                       lean_tuning=LEAN_TUNING if lean else "", lean_package=LEAN_PACKAGE if lean else ""))
    return path


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """tiny_cnn built for this machine with 2 trials for each of its 2 heaviest tasks, once per test run: under
    pytest-xdist the first worker to ask builds it (the others wait on a lock) and all read the one directory."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    directory, saved = shared / "tiny-build", shared / "tiny-build.json"
    with (shared / "tiny-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            directory.mkdir()
            write_tiny_recipe(directory, lean=False)
            done = run_edgetune("build", "tiny.yaml", "--json", "summary.json", cwd=directory)
            saved.write_text(json.dumps({"args": done.args, "returncode": done.returncode, "stdout": done.stdout,
                                         "stderr": done.stderr}))
        fields = json.loads(saved.read_text())
    run = subprocess.CompletedProcess(fields["args"], fields["returncode"], fields["stdout"], fields["stderr"])
    assert run.returncode == 0, run.stdout + run.stderr
    return directory, run
