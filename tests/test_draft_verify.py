"""Draft-then-verify search and its learned cost model."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.runner import RunnerResult
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

from edgetune.profiles import load_profile
from edgetune.tuning.analyzer import SpaceModel
from edgetune.tuning.cost_model import RankingCostModel
from edgetune.tuning.draft_verify import DraftVerifySearch, SearchCounts
from edgetune.tuning.records import RecordStore
from edgetune.tuning.tune import TuningPlan


def matmul(n: int) -> tvm.IRModule:
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c])})


def host_context(mod: tvm.IRModule, strategy="evolutionary") -> ms.TuneContext:
    return ms.TuneContext(mod=mod, target=load_profile("host").tvm_target(), space_generator="post-order-apply",
                          search_strategy=strategy, task_name="matmul", rand_state=3, num_threads=2)


def candidates_of(mod: tvm.IRModule, ctx: ms.TuneContext, count: int) -> list[MeasureCandidate]:
    space = ctx.space_generator.generate_design_space(mod)[0]
    model = SpaceModel.analyze(mod, space)
    rows = model.sample(np.random.default_rng(1), count)
    schedules = [model.materialize(mod, row, ctx.space_generator.postprocs, seed=i) for i, row in enumerate(rows)]
    return [MeasureCandidate(s, ArgInfo.from_entry_func(s.mod, remove_preproc=True)) for s in schedules if s]


def test_cost_model_save_load_round_trip_predicts_identically(tmp_path):
    mod = matmul(128)
    ctx = host_context(mod)
    candidates = candidates_of(mod, ctx, 24)
    model = RankingCostModel(num_threads=2)
    costs = np.random.default_rng(0).uniform(1e-4, 1e-3, len(candidates))
    model.update(ctx, candidates[:16], [RunnerResult([float(c)], None) for c in costs[:16]])
    assert model.trained
    path = tmp_path / "model.npz"
    model.save(str(path))
    restored = RankingCostModel(num_threads=2)
    restored.load(str(path))
    assert restored.size == model.size == 16
    np.testing.assert_array_equal(restored.predict(ctx, candidates), model.predict(ctx, candidates))
    assert np.ptp(model.predict(ctx, candidates)) > 0


def test_cost_model_keeps_itself_beside_the_records(tmp_path):
    mod = matmul(128)
    ctx = host_context(mod)
    candidates = candidates_of(mod, ctx, 12)
    path = tmp_path / "cost_model.npz"
    first = RankingCostModel(num_threads=2, path=path)
    first.update(ctx, candidates, [RunnerResult([1e-3 * (i + 1)], None) for i in range(len(candidates))])
    again = RankingCostModel(num_threads=2, path=path)  # a later build of the same target
    np.testing.assert_array_equal(again.predict(ctx, candidates), first.predict(ctx, candidates))


def test_failed_runs_rank_last():
    mod = matmul(128)
    ctx = host_context(mod)
    candidates = candidates_of(mod, ctx, 16)
    model = RankingCostModel(num_threads=2)
    results = [RunnerResult(None, "crashed") if i % 2 else RunnerResult([1e-3], None) for i in range(len(candidates))]
    model.update(ctx, candidates, results)
    scores = model.predict(ctx, candidates)
    assert scores[::2].mean() > scores[1::2].mean()


def test_clone_is_a_new_strategy_with_the_same_settings():
    strategy = DraftVerifySearch(load_profile("host").hardware, "cpu", population=512, verify=64)
    assert not strategy.clone().same_as(strategy)  # what MetaSchedule calls, through TVM's FFI
    twin = strategy._inst.clone()
    assert twin is not strategy
    assert (twin.population, twin.verify_count, twin.eps_greedy) == (512, 64, 0.1)


def test_rounds_draft_new_unique_candidates():
    """Each round proposes distinct schedules, never one measured before; early batches are small."""
    mod = matmul(256)
    strategy = DraftVerifySearch(load_profile("host").hardware, "cpu", population=512, verify=48)
    ctx = host_context(mod, strategy)
    spaces = ctx.space_generator.generate_design_space(mod)
    strategy.pre_tuning(64, 16, spaces, ms.database.MemoryDatabase(), RankingCostModel(num_threads=2))
    seen: set[int] = set()
    sizes = []
    for _ in range(3):
        batch = strategy.generate_measure_candidates()
        sizes.append(len(batch))
        hashes = {tvm_ffi.structural_hash(c.sch.mod) for c in batch}
        assert len(hashes) == len(batch) and not hashes & seen
        seen |= hashes
        strategy.notify_runner_results(batch, [RunnerResult([1e-3], None) for _ in batch])
    assert sizes == [8, 16, 16]


def test_tune_wires_draft_verify_with_a_model_kept_beside_the_records(tmp_path):
    """tune.py picks the strategy and the learned model from the plan; stock search stays stock."""
    from edgetune.tuning.tune import _cost_model, _search_strategy

    profile = load_profile("host")
    store = RecordStore(tmp_path / "records")
    plan = TuningPlan(trials_per_task=8, time_budget_s=None, search="draft-verify", seed=0, cores=2,
                      hardware=profile.hardware, device=profile.device, isa=profile.isa)
    assert isinstance(_search_strategy(plan, SearchCounts(), None, None, 8), DraftVerifySearch)
    model = _cost_model(plan, store, None)
    assert isinstance(model, RankingCostModel) and model.path == store.directory / "cost_model.npz"
    stock = TuningPlan(trials_per_task=8, time_budget_s=None, search="evolutionary", seed=0, cores=2)
    assert isinstance(_search_strategy(stock, SearchCounts(), None, None, 8), ms.search_strategy.EvolutionarySearch)
    assert isinstance(_cost_model(stock, store, None), ms.cost_model.XGBModel)


@pytest.mark.slow
def test_short_tuning_run_improves_on_its_first_batch(tmp_path):
    """24 real measurements of a 384^3 matmul in batches of 4: the best beats the first batch's."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import MeasureCallback, PyMeasureCallback

    from edgetune.tuning.builder import create_builder

    profile = load_profile("host")
    batches: list[float] = []

    @derived_object
    class BatchBest(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
            seconds = [np.mean([float(s) for s in r.run_secs]) for r in runner_results if r.error_msg is None]
            batches.append(min(seconds) if seconds else np.inf)

    model = RankingCostModel(num_threads=2, path=tmp_path / "cost_model.npz")
    strategy = DraftVerifySearch(profile.hardware, profile.device, profile.isa)
    ms.tune_tasks(
        tasks=[host_context(matmul(384), strategy)],
        task_weights=[1.0],
        work_dir=str(tmp_path),
        max_trials_global=24,
        num_trials_per_iter=4,
        builder=create_builder(max_workers=2),
        runner=ms.runner.LocalRunner(),
        database=ms.database.MemoryDatabase(),
        cost_model=model,
        measure_callbacks=list(MeasureCallback.create("default")) + [BatchBest()],
        task_scheduler="round-robin",
    )
    assert len(batches) == 6 and np.isfinite(batches[0])
    assert min(batches[1:]) < batches[0]
    assert model.size == 24 and (tmp_path / "cost_model.npz").exists()
