"""Draft-then-verify search and its learned cost model."""

from __future__ import annotations

import json
import math

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
from edgetune.tuning.analyzer.space import replay
from edgetune.tuning.cost_model.ranking import RankingCostModel
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.intrinsics import register_tensor_intrinsics
from edgetune.tuning.search_strategy.draft_verify import (
    FALLBACK_PER_TRIAL,
    FIRST_BATCHES,
    LEARNED_FROM,
    UNLEARNED_VERIFY_PER_TRIAL,
    DraftVerifySearch,
    SearchCounts,
)
from edgetune.tuning.tune import TuningPlan


def matmul(n: int) -> tvm.IRModule:
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c])})


def unscheduled_matmul_seconds(n: int, target: tvm.target.Target) -> float:
    """Seconds per run of `matmul(n)` compiled as written (TVM's default loops), timed here."""
    library = tvm.compile(matmul(n), target=target)
    device = tvm.cpu()
    arrays = [tvm.runtime.tensor(np.ones((n, n), "float32"), device) for _ in range(3)]
    return library.mod.time_evaluator("main", device, number=3, repeat=1)(*arrays).mean


def host_context(mod: tvm.IRModule, strategy="evolutionary") -> ms.TuneContext:
    register_tensor_intrinsics(load_profile("host").tvm_target())  # as a build does (TuneContext alone: 35 s)
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
    model.predict(ctx, candidates)  # fits what the batch measured
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


def test_the_cost_model_refits_before_ranking_a_task_it_has_not_learned_or_once_its_data_grew():
    """A refit after every batch cost a 4-minute MobileNet-V2 build a third of its rounds' time. The model learns a
    task's measurements before it ranks that task again, and the others' once the data grew by REFIT_GROWTH."""
    from edgetune.tuning.cost_model.ranking import REFIT_GROWTH

    rng = np.random.default_rng(0)
    model = RankingCostModel(num_threads=2, rounds=5)

    def measure(key: str, count: int) -> None:
        rows = rng.random((count, 9)).astype(np.float32)
        model.add(key, rows, [RunnerResult([float(1e-4 * (1 + r[0]))], None) for r in rows])

    def refits_before_ranking(key: str) -> bool:
        booster = model.booster
        model.scores(key, rng.random((3, 9)).astype(np.float32))
        return model.booster is not booster

    measure("a", 16)
    measure("b", 16)
    assert not model.trained  # measurements kept, not fit yet
    assert refits_before_ranking("a") and model.trained
    assert not refits_before_ranking("a") and not refits_before_ranking("b")
    measure("b", 2)
    assert not refits_before_ranking("a")  # b's 2 new rows: 6% more data
    assert refits_before_ranking("b")  # but b is ranked on everything it measured
    grown = math.ceil(REFIT_GROWTH * model.size)
    measure("c", grown - 1)
    assert not refits_before_ranking("a")
    measure("c", 1)
    assert refits_before_ranking("a")
    assert not refits_before_ranking("c")  # that refit learned c's rows too


def test_a_saved_cost_model_remembers_which_measurements_it_learned(tmp_path):
    """Saved after every batch, a model may hold measurements it has not fit yet: loaded, it refits before ranking
    their task, and a model saved before this was counted had learned all of its data."""
    path = tmp_path / "cost_model.npz"
    rng = np.random.default_rng(1)
    model = RankingCostModel(num_threads=2, rounds=5, path=path)
    for key in ("a", "b"):
        rows = rng.random((8, 9)).astype(np.float32)
        model.add(key, rows, [RunnerResult([float(1e-4 * (1 + r[0]))], None) for r in rows])
    assert RankingCostModel(num_threads=2, rounds=5, path=path).fitted == {"a": 0, "b": 0}  # saved, not fit
    model.fit_if_stale("a")
    rows = rng.random((2, 9)).astype(np.float32)
    model.add("b", rows, [RunnerResult([1e-4], None), RunnerResult([2e-4], None)])
    again = RankingCostModel(num_threads=2, rounds=5, path=path)
    assert again.fitted == {"a": 8, "b": 8} and again.size == 18
    assert not again.fit_if_stale("a") and again.fit_if_stale("b")

    with np.load(path) as data:  # as an earlier edgetune saved it: no "fitted" in its meta
        arrays = dict(data)
    meta = json.loads(bytes(arrays["meta"]).decode())
    del meta["fitted"]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)
    assert RankingCostModel(num_threads=2, rounds=5, path=path).fitted == {"a": 8, "b": 10}


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


def test_the_analyzers_best_drafts_come_without_a_database_and_leave_the_strategy_fresh():
    """What the first batch measures of a task without a sibling's seed: the round's first picks, distinct,
    drafted before anything of the task was measured; the strategy is ready for the task's own round after."""
    from edgetune.tuning.search_strategy.draft_verify import analyzer_best

    mod = matmul(128)
    strategy = DraftVerifySearch(load_profile("host").hardware, "cpu", population=256)
    ctx = host_context(mod, strategy)
    drafts = analyzer_best(ctx, strategy, 2)
    assert len({tvm_ffi.structural_hash(c.sch.mod) for c in drafts}) == len(drafts) == 2
    assert strategy.spaces == [] and strategy.counts.drafted > 0


def test_until_the_learned_model_counts_a_round_materializes_only_a_few_drafts_per_candidate():
    """Below LEARNED_FROM measurements the score is the analyzer's alone: no need to build 96 schedules."""
    mod = matmul(128)
    strategy = DraftVerifySearch(load_profile("host").hardware, "cpu", population=256, verify=96)
    ctx = host_context(mod, strategy)
    model = RankingCostModel(num_threads=2)
    strategy.pre_tuning(64, 16, ctx.space_generator.generate_design_space(mod), ms.database.MemoryDatabase(), model)
    rng = np.random.default_rng(0)
    verified = []
    while len(strategy.measured) <= LEARNED_FROM:
        before = strategy.counts.verified
        batch = strategy.generate_measure_candidates()
        verified.append(strategy.counts.verified - before)
        assert verified[-1] <= UNLEARNED_VERIFY_PER_TRIAL * len(batch)
        results = [RunnerResult([float(t)], None) for t in rng.uniform(1e-4, 1e-3, len(batch))]
        model.update(ctx, batch, results)  # as MetaSchedule's UpdateCostModel callback does
        strategy.notify_runner_results(batch, results)
    before = strategy.counts.verified
    strategy.generate_measure_candidates()
    assert strategy.counts.verified - before > max(verified)  # now the learned model ranks 96


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


@pytest.mark.serial
@pytest.mark.slow
def test_short_tuning_run_improves_on_its_first_batch(tmp_path):
    """24 real measurements of a 384^3 matmul in batches of 4: the analyzer's first batch is many times
    faster than the unscheduled matmul, and the later batches (drafted further, verified by the learned
    model) stay near its quality: the median of their candidates within 2x of the first batch's best. Here
    that median was 1.08x in two runs; random sampling of the same space (replay-trace) gave 3-4x. Whether a
    later batch beats the first is luck: on CI the first batch once held the best of the 24 by 0.6%, once by
    26%."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import MeasureCallback, PyMeasureCallback

    from edgetune.tuning.builder import CandidateBuilder
    from edgetune.tuning.local_runner import LocalCandidateRunner

    profile = load_profile("host")
    batches: list[float] = []
    failures: list[str] = []
    measured = [0]

    @derived_object
    class BatchBest(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
            seconds = [np.mean([float(s) for s in r.run_secs]) for r in runner_results if r.error_msg is None]
            failures.extend(str(b.error_msg or r.error_msg)[:300] for b, r in zip(builder_results, runner_results)
                            if b.error_msg is not None or r.error_msg is not None)
            measured[0] += len(runner_results)
            batches.append(seconds)

    model = RankingCostModel(num_threads=2, path=tmp_path / "cost_model.npz")
    strategy = DraftVerifySearch(profile.hardware, profile.device, profile.isa)
    ms.tune_tasks(
        tasks=[host_context(matmul(384), strategy)],
        task_weights=[1.0],
        work_dir=str(tmp_path),
        max_trials_global=24,
        num_trials_per_iter=4,
        builder=CandidateBuilder(max_workers=2),
        runner=LocalCandidateRunner(),
        database=ms.database.MemoryDatabase(),
        cost_model=model,
        measure_callbacks=list(MeasureCallback.create("default")) + [BatchBest()],
        task_scheduler="round-robin",
    )
    assert len(batches) == 6 and batches[0]
    first_best = min(batches[0])
    assert first_best * 20 < unscheduled_matmul_seconds(384, profile.tvm_target())
    assert np.median([s for batch in batches[1:] for s in batch]) < first_best * 2
    # MetaSchedule's UpdateCostModel hands the model only what built and ran, and the model keeps every one of
    # them (on CI the model once held 23 of 24)
    assert 22 <= measured[0] <= 24 and len(failures) <= 2, failures
    assert model.size == measured[0] - len(failures) and (tmp_path / "cost_model.npz").exists()


@pytest.mark.slow
def test_a_build_from_scratch_gives_every_task_the_analyzers_best_drafts_in_one_batch_before_any_round(tmp_path):
    """No records, no siblings: the first thing measured is one batch of every task's best drafts, each built
    and run, more of the heavier task's (3.4x the other's FLOPs); the model's tuning curve starts when it ends,
    before any task's round; each round then measures the rest of its task's trials, never a draft twice. The
    stock search has no analyzer: it starts with rounds."""
    from edgetune.tuning.tasks import TuningTask
    from edgetune.tuning.tune import FIRST_DRAFTS, FIRST_DRAFTS_HEAVY, tune

    profile = load_profile("host")
    tasks = [TuningTask(f"matmul{n}", matmul(n), 1, 2.0 * n ** 3) for n in (64, 96)]
    trials = 6
    store = RecordStore(tmp_path / "scratch")
    plan = TuningPlan(trials, None, "draft-verify", 0, 2, profile.hardware, profile.device, profile.isa)
    result = tune(tasks, profile.tvm_target(), store, plan)
    log = store.read_log()
    counts = [FIRST_DRAFTS, FIRST_DRAFTS_HEAVY]
    first = sum(counts)
    assert [(e["task"], e["measured"]) for e in log[:first]] == [(t.name, 1) for t, c in zip(tasks, counts) for _ in range(c)]
    assert all(e["batch_best_us"] for e in log[:first])  # built and run
    # the log says its times to the millisecond
    assert log[first - 1]["elapsed_s"] <= round(result.curve[0][0], 3) <= log[first]["elapsed_s"]
    assert [e["task"] for e in log[first:]] == [t.name for t in tasks]  # one round each: the rest of its trials
    for task in tasks:
        records = store.database.get_top_k(store.database.commit_workload(task.mod), 100)
        assert len({str(record.trace) for record in records}) == len(records) == trials

    stock = RecordStore(tmp_path / "stock")
    tune(tasks, profile.tvm_target(), stock, TuningPlan(trials, None, "evolutionary", 0, 2))
    assert stock.read_log()[0]["measured"] > 1


def test_the_tasks_that_hold_the_models_flops_get_more_first_drafts():
    """Four drafts for a task with at least half the heaviest task's FLOPs (per call x calls), two for the rest:
    ResNet-18's four 3x3 stages (one called 4 times, three 3 times) against its stem, strided and 1x1 ones."""
    from edgetune.tuning.tune import FIRST_DRAFTS, FIRST_DRAFTS_HEAVY, first_draft_counts

    mflops = [231.0 * 4, 231.0 * 3, 231.0 * 3, 231.0 * 3, 236.0, 115.0, 115.0, 115.0, 12.8, 1.0]
    assert first_draft_counts(mflops) == [FIRST_DRAFTS_HEAVY] * 4 + [FIRST_DRAFTS] * 6
    assert first_draft_counts([0.0, 0.0]) == [FIRST_DRAFTS] * 2 and first_draft_counts([]) == []


def test_the_first_drafts_made_on_the_tunings_workers_are_those_made_here():
    """A MobileNet-V2's 34 tasks took 21 s to draft in the main process, on one of two cores, while the workers
    waited: each task is now drafted on a worker. The drafts come back as traces, replayed here: the same
    programs as drafted in this process, with the search's counts, in the order of the positions asked for."""
    from edgetune.tuning.task_scheduler import TaskOutcome
    from edgetune.tuning.tasks import TuningTask
    from edgetune.tuning.tune import TuningResult, _first_drafts, first_draft_counts
    from edgetune.tuning.worker_pool import WorkerPool

    profile = load_profile("host")
    tasks = [TuningTask(f"matmul{n}", matmul(n), 1, 2.0 * n ** 3) for n in (64, 96, 128)]
    plan = TuningPlan(8, None, "draft-verify", 0, 2, profile.hardware, profile.device, profile.isa)

    def drafted(pool):
        result = TuningResult(tasks=[TaskOutcome(t.name, 1, t.flops, 0, 0, None) for t in tasks])
        drafts = _first_drafts(tasks, result, profile.tvm_target(), plan, pool)
        return [(p, [tvm_ffi.structural_hash(c.sch.mod) for c in candidates])
                for p, _, candidates in drafts([2, 0])], [o.search.drafted for o in result.tasks]

    pool = WorkerPool(2, None)
    try:
        on_workers, counted = drafted(pool)
    finally:
        pool.shutdown()
    here, counted_here = drafted(None)
    assert on_workers == here and [p for p, _ in here] == [2, 0]
    wanted = first_draft_counts([t.total_flops for t in tasks])
    assert [len(set(programs)) for _, programs in here] == [wanted[2], wanted[0]] == [4, 2]
    assert counted == counted_here and counted[0] > 0 and counted[2] > 0 and counted[1] == 0


@pytest.mark.slow
def test_the_tuning_says_how_long_each_of_its_phases_took(tmp_path):
    """A busy build once measured nothing for about 350 s after its first batch, and its summary said only that
    the budget had stopped it. Each phase's seconds now go into the result (and the summary's
    `tuning_phases_s`): the first batch, the cost model's first fits, the budget's reserve (here a call that
    takes 0.3 s), and the rounds without it; together no more than the tuning's wall time."""
    import time

    from edgetune.tuning.tasks import TuningTask
    from edgetune.tuning.tune import tune

    profile = load_profile("host")
    asked: list[float] = []

    def reserve() -> float:
        time.sleep(0.3)
        asked.append(time.monotonic())
        return 1.0

    plan = TuningPlan(16, 600.0, "draft-verify", 0, 2, profile.hardware, profile.device, profile.isa,
                      keep_for_later=reserve)
    result = tune([TuningTask("matmul64", matmul(64), 1, 2.0 * 64 ** 3)], profile.tvm_target(),
                  RecordStore(tmp_path / "store"), plan)
    assert list(result.phases_s) == ["first_batch", "first_fits", "reserve", "rounds"]
    assert len(asked) == 1 and 0.3 <= result.phases_s["reserve"] < 5.0
    assert min(result.phases_s.values()) >= 0 and result.phases_s["first_batch"] > 0 and result.phases_s["rounds"] > 0
    assert sum(result.phases_s.values()) <= result.wall_s


# -- every kind of task, and the guards on degenerate figures ------------------------------------


def transpose(rows: int, cols: int) -> tvm.IRModule:
    a = te.placeholder((rows, cols), name="A")
    b = te.compute((cols, rows), lambda i, j: a[j, i], name="B")
    return tvm.IRModule({"main": te.create_prim_func([a, b])})


def started_search(mod: tvm.IRModule, hardware=None, trials: int = 8, per_iter: int = 4) -> DraftVerifySearch:
    """A draft-verify search ready to propose candidates for `mod` (small population: fast)."""
    strategy = DraftVerifySearch(hardware or load_profile("host").hardware, "cpu", population=256, verify=16)
    ctx = host_context(mod, strategy)
    spaces = ctx.space_generator.generate_design_space(mod)
    strategy.pre_tuning(trials, per_iter, spaces, ms.database.MemoryDatabase(), RankingCostModel(num_threads=2))
    return strategy


def measured_fine(batch) -> list[RunnerResult]:
    return [RunnerResult([1e-3], None) for _ in batch]


def test_a_space_with_no_decision_measures_its_one_design_once():
    """A transpose's design space has no tunable decision (width 0): it used to divide by zero."""
    mod = transpose(64, 32)
    strategy = started_search(mod)
    assert [space.model.width for space in strategy.spaces] == [0]
    batch = strategy.generate_measure_candidates()
    assert len(batch) == 1 and strategy.counts.fallback == "no tunable decision"
    strategy.notify_runner_results(batch, measured_fine(batch))
    assert strategy.generate_measure_candidates() is None  # nothing else to measure: the task ends


def test_an_analyzer_that_scores_nothing_hands_the_task_to_evolutionary_search():
    """With a clock of 0 Hz every estimate is infinite: no draft; the stock search measures instead."""
    hardware = load_profile("host").hardware.model_copy(update={"clock_ghz": 0.0})
    strategy = started_search(matmul(64), hardware)
    with np.errstate(divide="ignore", invalid="ignore"):
        batch = strategy.generate_measure_candidates()
    assert batch and strategy.counts.fallback == "the analyzer scored none of the candidates: evolutionary search"
    strategy.notify_runner_results(batch, measured_fine(batch))
    assert strategy.trials == len(batch)
    again = strategy.generate_measure_candidates()
    assert again and not {tvm_ffi.structural_hash(c.sch.mod) for c in again} & {
        tvm_ffi.structural_hash(c.sch.mod) for c in batch}
    strategy.post_tuning()


def test_degenerate_extents_and_estimates_are_guarded():
    from edgetune.tuning.analyzer.space import Sym, UnsupportedSpace, perfect_tilings
    from edgetune.tuning.cost_model.ranking import rank
    from edgetune.tuning.search_strategy.draft_verify import log_latency

    with pytest.raises(UnsupportedSpace):
        perfect_tilings(0, 2, 0)
    with pytest.raises(UnsupportedSpace):
        Sym(0.0).inverse()
    logs = log_latency([0.0, np.inf, np.nan, 1e-3])
    assert np.isfinite(logs).all() and logs[0] < logs[3] < logs[1] == logs[2]
    assert len(rank(np.zeros(0))) == 0


def test_zero_and_failed_run_times_train_no_nan():
    """A kernel timed at 0 s must not make a label 0/0; a task whose every run failed trains nothing."""
    from edgetune.tuning.cost_model.ranking import ranking_data

    _rows, labels, sizes = ranking_data({"t": ([np.ones(3), np.zeros(3)], [0.0, 1e-3])})
    assert np.isfinite(labels).all() and labels[0] == 1.0 and sizes == [2]
    assert ranking_data({"t": ([np.ones(3), np.zeros(3)], [float("inf"), float("inf")])}) is None
    mod = matmul(64)
    ctx = host_context(mod)
    candidates = candidates_of(mod, ctx, 8)
    model = RankingCostModel(num_threads=2)
    model.update(ctx, candidates, [RunnerResult(None, "failed") for _ in candidates])
    assert not model.trained and (model.predict(ctx, candidates) == 0).all()
    model.update(ctx, candidates, [RunnerResult([0.0], None) for _ in candidates])
    assert np.isfinite(model.predict(ctx, candidates)).all()


def every_op_model(path) -> None:
    """One ONNX model with each kind of task issue 28 names: BatchNorm + ReLU (not after a conv),
    depthwise and grouped conv, max and global average pooling, elementwise Mul/Add, Concat,
    Transpose, Reshape, LayerNorm, batched and 2-D MatMul, Softmax, ReduceMean and Gemm."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(np.array([1, 16, 16], dtype=np.int64), "shape"),
                    numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")]

    def weight(name: str, *shape: int) -> str:
        initializers.append(numpy_helper.from_array((rng.random(shape) - 0.5).astype(np.float32), name))
        return name

    node = helper.make_node
    nodes = [
        node("BatchNormalization", ["data", weight("g", 8), weight("b", 8), weight("m", 8), "var"], ["bn"]),
        node("Relu", ["bn"], ["relu"]),
        node("Conv", ["relu", weight("wd", 8, 1, 3, 3)], ["dw"], group=8, pads=[1, 1, 1, 1]),
        node("Conv", ["dw", weight("wg", 8, 2, 3, 3)], ["gc"], group=4, pads=[1, 1, 1, 1]),
        node("MaxPool", ["gc"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        node("Mul", ["mp", weight("s", 1, 8, 1, 1)], ["mul"]),
        node("Add", ["mul", "mp"], ["add"]),
        node("Concat", ["add", "mp"], ["cat"], axis=1),
        node("Transpose", ["cat"], ["tr"], perm=[0, 2, 3, 1]),
        node("Reshape", ["tr", "shape"], ["seq"]),
        node("LayerNormalization", ["seq", weight("lg", 16), weight("lb", 16)], ["ln"], axis=-1),
        node("Transpose", ["ln"], ["ln_t"], perm=[0, 2, 1]),
        node("MatMul", ["ln", "ln_t"], ["scores"]),
        node("Softmax", ["scores"], ["attention"], axis=-1),
        node("MatMul", ["attention", "ln"], ["context"]),
        node("ReduceMean", ["context", "axes"], ["pooled"], keepdims=0),
        node("MatMul", ["pooled", weight("w2", 16, 16)], ["dense"]),
        node("Gemm", ["dense", weight("wl", 10, 16), weight("bl", 10)], ["head"], transB=1),
        node("GlobalAveragePool", ["gc"], ["gap"]),
        node("Flatten", ["gap"], ["flat"]),
        node("Gemm", ["flat", weight("wf", 10, 8)], ["side"], transB=1),
        node("Add", ["head", "side"], ["logits"]),
    ]
    initializers.append(numpy_helper.from_array((rng.random(8) + 0.5).astype(np.float32), "var"))
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 8, 8, 8])
    graph = helper.make_graph(nodes, "every_op", [data],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), path)


@pytest.mark.slow
def test_draft_verify_proposes_candidates_for_every_task_of_every_op_kind(tmp_path):
    """Each task of a model with every kind of op gets candidates; where the analyzer cannot read a
    space or the space has no decision, the fallback is counted. Used to raise 'float division by zero'."""
    from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
    from edgetune.tuning.tasks import extract_tasks

    every_op_model(tmp_path / "every_op.onnx")
    target = load_profile("host").tvm_target()
    model = load_model(zoo=None, onnx_path=tmp_path / "every_op.onnx", input_shapes=None)
    tasks = extract_tasks(fuse_for_tuning(to_relax(model), target), target)
    names = " ".join(t.name for t in tasks)
    for kind in ("conv2d", "matmul", "transpose", "reshape", "concatenate", "relu", "softmax", "layer_norm", "mean",
                 "max_pool2d"):
        assert kind in names
    fallbacks = {}
    for task in tasks:
        strategy = started_search(task.mod, trials=4, per_iter=2)
        batch = strategy.generate_measure_candidates()
        assert batch, task.name
        strategy.notify_runner_results(batch, measured_fine(batch))
        fallbacks[task.name] = strategy.counts.fallback
    no_decision = [name for name, reason in fallbacks.items() if reason == "no tunable decision"]
    unread = [name for name, reason in fallbacks.items() if reason and reason.startswith("analyzer cannot read")]
    assert any("transpose" in name for name in no_decision) and any("softmax" in name for name in unread)
    assert fallbacks[next(t.name for t in tasks if t.name.startswith("conv2d"))] is None  # a readable space


def test_a_space_drafted_by_tvm_sampling_replays_a_few_candidates_per_trial_and_pools_the_rest():
    """Each candidate drafted by TVM's sampling is a replay with the postprocessors (a quarter of a ResNet-18
    build went there): a batch replays about FALLBACK_PER_TRIAL per candidate, and the drafts it did not
    measure stay in the space's pool for the next batch, which never measures a program twice."""
    from tvm import topi

    data = te.placeholder((64, 1000), name="data")
    mod = tvm.IRModule({"main": te.create_prim_func([data, topi.nn.softmax(data)])})
    strategy = started_search(mod, trials=64, per_iter=32)
    spaces = len(strategy.spaces)
    assert spaces and all(space.model is None for space in strategy.spaces)  # softmax: drafted by TVM's sampling
    seen: set[int] = set()
    for size in FIRST_BATCHES:
        explored = strategy.counts.explored
        batch = strategy.generate_measure_candidates()
        assert len(batch) == size
        assert strategy.counts.explored - explored <= spaces * max(8, -(-FALLBACK_PER_TRIAL * size // spaces))
        hashes = {tvm_ffi.structural_hash(c.sch.mod) for c in batch}
        assert len(hashes) == size and not hashes & seen
        seen |= hashes
        strategy.notify_runner_results(batch, measured_fine(batch))
        pooled = [draft for space in strategy.spaces for draft in space.pool]
        assert pooled and not any(draft.key in strategy.measured for draft in pooled)  # left for the next batch


def test_a_later_round_knows_a_sampled_spaces_measured_programs_without_replaying_them_again(monkeypatch):
    """Each round of a task is a new strategy, and records of a space drafted by TVM's sampling are known by
    their programs: a replay each. Rounds under a budget are short, so a task's records were replayed many
    times over; now once per process, and the next round still measures none of those programs."""
    from tvm import topi

    data = te.placeholder((64, 1000), name="data")
    mod = tvm.IRModule({"main": te.create_prim_func([data, topi.nn.softmax(data)])})
    database = ms.database.MemoryDatabase()
    workload = database.commit_workload(mod)
    from edgetune.tuning.search_strategy import draft_verify

    replays = []

    def counted(*args):
        replays.append(args[1])
        return replay(*args)

    monkeypatch.setattr(draft_verify, "replay", counted)  # the real replay, counted

    def round_of(trials: int) -> tuple[DraftVerifySearch, int, set[int]]:
        strategy = DraftVerifySearch(load_profile("host").hardware, "cpu", population=256, verify=16)
        ctx = host_context(mod, strategy)
        replays.clear()
        strategy.pre_tuning(trials, trials, ctx.space_generator.generate_design_space(mod), database,
                            RankingCostModel(num_threads=2))
        at_start = len(replays)
        batch = strategy.generate_measure_candidates()
        for candidate in batch:
            database.commit_tuning_record(ms.database.TuningRecord(candidate.sch.trace, workload, [1e-3],
                                                                   ctx.target, candidate.args_info))
        strategy.notify_runner_results(batch, measured_fine(batch))
        return strategy, at_start, {tvm_ffi.structural_hash(c.sch.mod) for c in batch}

    _, _, first = round_of(8)
    _, replayed_second, second = round_of(8)
    _, replayed_third, third = round_of(8)
    assert replayed_second == len(first)  # the first round's records: not known yet
    assert replayed_third == len(second)  # only the second round's are new; the first round's are known
    assert not (first & second) and not ((first | second) & third)
