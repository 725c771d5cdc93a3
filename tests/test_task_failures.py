"""One task whose tuning fails never sinks the build: it keeps its best schedule so far, the other
tasks are tuned, the artifact is verified, and the summary counts every committed measurement."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgetune.tuning.task_scheduler import TaskOutcome, trials_that_fit

RECIPE = """\
name: failing
model:
  onnx: model.onnx
fleet:
  - name: host
    profile: host
tuning:
  search: draft-verify
  trials_per_task: 5
  seed: 1
  in_model_candidates: 1
package:
  thread_wait: spin
records_dir: records
output: out
"""

INJECTED = "injected failure: this search cannot go on"


def small_model(path: Path) -> None:
    """BatchNorm + ReLU (no tunable decision), a conv, a transpose and a dense layer: four kinds of task."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    initializers = []

    def weight(name: str, *shape: int, offset: float = -0.5) -> str:
        initializers.append(numpy_helper.from_array((rng.random(shape) + offset).astype(np.float32), name))
        return name

    node = helper.make_node
    nodes = [
        node("BatchNormalization", ["data", weight("g", 4), weight("b", 4), weight("m", 4), weight("v", 4, offset=0.5)],
             ["bn"]),
        node("Relu", ["bn"], ["relu"]),
        node("Conv", ["relu", weight("w", 8, 4, 3, 3)], ["conv"], pads=[1, 1, 1, 1]),
        node("Transpose", ["conv"], ["nhwc"], perm=[0, 2, 3, 1]),
        node("Flatten", ["nhwc"], ["flat"]),
        node("Gemm", ["flat", weight("wl", 10, 8 * 8 * 8), weight("bl", 10)], ["logits"], transB=1),
    ]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def failing_search(task_marker: str):
    """Draft-verify that raises on the task whose name contains `task_marker` once the task has a
    measurement (of this round or of an earlier build): the isolation seam under test is tune.py's,
    the search's own code is real."""
    from tvm.ir.utils import derived_object

    from edgetune.tuning.search_strategy.draft_verify import DraftVerifySearch

    @derived_object
    class FailsOnOneTask(DraftVerifySearch._cls):
        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
            super().pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)
            if self.failing:
                self.per_iter = 1  # one candidate measured, and committed, before the failure

        @property
        def failing(self) -> bool:
            return task_marker in str(self.context.task_name)

        def generate_measure_candidates(self):
            if self.failing and (self.trials or self.measured):
                raise ValueError(INJECTED)
            return super().generate_measure_candidates()

    return FailsOnOneTask


def committed(directory: Path) -> int:
    from edgetune.tuning.database.store import RecordStore

    (store,) = directory.glob("records/host-*")
    return sum(RecordStore(store).measured_counts().values())


@pytest.mark.slow
def test_a_task_whose_tuning_raises_keeps_the_build_verified(tmp_path, monkeypatch):
    """A real draft-verify build in which the conv task's search raises in its first round, after its first
    batch's drafts (made on a worker of the tuning, by the search as it ships) were measured: exit 0 with a
    warning, the artifact verified, the other tasks tuned, every committed record counted; --strict: 1."""
    from typer.testing import CliRunner

    import edgetune.tuning.search_strategy as search_strategy_module
    from edgetune.cli import app
    from edgetune.tuning.tune import first_draft_counts

    small_model(tmp_path / "model.onnx")
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(search_strategy_module, "DraftVerifySearch", failing_search("conv2d"))

    run = CliRunner().invoke(app, ["build", "recipe.yaml", "--json", "summary.json"])
    assert run.exit_code == 0, run.output
    assert "warning: tuning failed for task" in run.output and INJECTED in run.output
    host = json.loads((tmp_path / "summary.json").read_text())["targets"]["host"]
    assert host["error"] is None and host["verified"] is True
    failed = [t for t in host["tasks"] if t["tuning_failed"]]
    assert [t["name"] for t in failed] == [next(t["name"] for t in host["tasks"] if "conv2d" in t["name"])]
    drafts = first_draft_counts([t["flops"] * t["weight"] for t in host["tasks"]])
    first_batch = min(drafts[host["tasks"].index(failed[0])], yaml.safe_load(RECIPE)["tuning"]["trials_per_task"])
    assert INJECTED in failed[0]["tuning_failed"] and failed[0]["trials_measured_now"] == first_batch
    assert failed[0]["best_us"] is not None  # its first drafts are its schedule
    assert host["tuning_failed"] == [f"{failed[0]['name']}: {failed[0]['tuning_failed']}"]
    others = [t for t in host["tasks"] if not t["tuning_failed"]]
    assert others and all(t["trials_measured_now"] >= 1 for t in others)
    assert any(t["search_fallback"] == "no tunable decision" for t in others)  # BatchNorm + ReLU, the transpose
    assert host["trials_measured"] == committed(tmp_path) == sum(t["trials_measured_now"] for t in host["tasks"])
    report = (tmp_path / "out" / "failing" / "report.html").read_text()
    assert "tuning failed" in report and INJECTED in report

    before = committed(tmp_path)
    strict = CliRunner().invoke(app, ["build", "recipe.yaml", "--strict", "--json", "again.json"])
    assert strict.exit_code == 1, strict.output  # the conv task resumed and failed again
    again = json.loads((tmp_path / "again.json").read_text())["targets"]["host"]
    assert again["error"] is None and again["verified"] is True and len(again["tuning_failed"]) == 1
    assert again["trials_measured"] == committed(tmp_path) - before == 0


def test_pace_of_a_task_with_no_recorded_time_is_not_a_division_by_zero():
    """A round that raised right after measuring leaves trials but (before the fix) no tuning time."""
    outcome = TaskOutcome("t", 1, 1e6, trials_before=0, trials_measured=3, best_us=0.0)
    assert trials_that_fit(8, outcome, left_s=10.0) == 8
    assert outcome.gflops is None  # a best of 0 us has no throughput
