"""How a tuning budget is spread over a model's tasks: passes of growing trial caps, each after the
first in order of the time the model spends in each kernel."""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import te
from tvm.s_tir.meta_schedule.database import TuningRecord

from edgetune.tuning import tune as tune_module
from edgetune.tuning.records import RecordStore
from edgetune.tuning.tasks import TuningTask
from edgetune.tuning.tune import TaskOutcome, TuningPlan, by_model_time, trial_caps, trials_that_fit, tune


def _task(name: str, n: int, weight: int) -> TuningTask:
    a = te.placeholder((n,), name="A")
    b = te.compute((n,), lambda i: a[i] * 2.0, name="B")
    return TuningTask(name, tvm.IRModule({"main": te.create_prim_func([a, b])}), weight, float(n))


def _measured(store: RecordStore, task: TuningTask, seconds: float) -> None:
    """A record of a schedule of the task with this run time, as if it had been measured."""
    workload = store.database.commit_workload(task.mod)
    schedule = tvm.s_tir.Schedule(task.mod)
    (loop,) = schedule.get_loops(schedule.get_sblock("B"))
    schedule.split(loop, [None, 4])
    trace = schedule.trace
    store.database.commit_tuning_record(TuningRecord(trace, workload, [seconds], tvm.target.Target({"kind": "llvm"})))


def test_later_passes_go_to_the_kernels_the_model_spends_most_time_in(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "store")
    heavy_by_flops = _task("many_flops_fast", 4096, weight=1)
    called_often = _task("called_three_times", 64, weight=3)
    untuned = _task("no_valid_record", 128, weight=1)
    _measured(store, heavy_by_flops, 1.0e-3)
    _measured(store, called_often, 0.5e-3)  # 3 x 0.5 ms per inference beats 1 x 1 ms
    tasks = [heavy_by_flops, called_often, untuned]
    assert [tasks[i].name for i in by_model_time(tasks, store)] == [
        "no_valid_record", "called_three_times", "many_flops_fast"]


def test_a_budget_gets_a_short_first_pass_then_doubling_caps() -> None:
    def caps(trials: int, budget_s: float | None) -> list[int]:
        return trial_caps(TuningPlan(trials, budget_s, "evolutionary", 0, 2))

    assert caps(32, None) == [32]  # no budget: every task gets its trials in one go, heaviest first
    assert caps(200, 600.0) == [8, 64, 128, 200]
    assert caps(6, 600.0) == [6]
    assert caps(1_000_000, 3600.0)[:5] == [8, 64, 128, 256, 512]


def test_a_round_is_cut_to_what_fits_in_the_budget_at_the_pace_of_earlier_rounds() -> None:
    outcome = TaskOutcome("conv", 1, 1.0, trials_before=0, trials_measured=8, best_us=100.0, tuning_s=40.0)
    assert trials_that_fit(56, outcome, left_s=100.0) == 20  # 5 s per trial so far
    assert trials_that_fit(56, outcome, left_s=1000.0) == 56
    assert trials_that_fit(56, outcome, left_s=-1.0) == 0
    fresh = TaskOutcome("conv", 1, 1.0, trials_before=0, trials_measured=0, best_us=None)
    assert trials_that_fit(8, fresh, left_s=1.0) == 8  # no pace yet: its first round runs


def test_a_task_whose_schedules_are_all_measured_is_not_searched_again(tmp_path: Path, monkeypatch) -> None:
    """A tiny elementwise kernel offers a few distinct schedules; later passes would search it in vain."""
    visits = []

    def counted(*args, **kwargs):
        visits.append(args[0].name)
        return tune_one(*args, **kwargs)

    tune_one = tune_module._tune_one
    monkeypatch.setattr(tune_module, "_tune_one", counted)
    store = RecordStore(tmp_path / "store")
    plan = TuningPlan(trials_per_task=200, time_budget_s=600.0, search="evolutionary", seed=0, cores=2)
    result = tune([_task("tiny_elementwise", 64, weight=1)], tvm.target.Target({"kind": "llvm", "num-cores": 2}),
                  store, plan)
    (outcome,) = result.tasks
    assert outcome.space_exhausted
    assert 0 < outcome.trials_measured < trial_caps(plan)[0]
    assert visits == ["tiny_elementwise"]  # one pass of four
    assert [entry["measured"] for entry in store.read_log()] == [outcome.trials_measured]  # no empty batches
