"""How a tuning budget is spread over a model's tasks: a short first pass over all of them, then each
round to the task expected to save the model the most latency per second of tuning."""

from __future__ import annotations

from pathlib import Path

import pytest
import tvm
from tvm import te

from edgetune.tuning import tune as tune_module
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.task_scheduler import TaskOutcome, next_round, trials_that_fit
from edgetune.tuning.tasks import TuningTask
from edgetune.tuning.tune import TuningPlan, tune


def _task(name: str, n: int, weight: int) -> TuningTask:
    a = te.placeholder((n,), name="A")
    b = te.compute((n,), lambda i: a[i] * 2.0, name="B")
    return TuningTask(name, tvm.IRModule({"main": te.create_prim_func([a, b])}), weight, float(n))


def _tuned(name: str, weight: int, best_us: float | None, tuning_s: float, last_round_s: float = 0.0,
           last_round_gain_us: float = 0.0, trials: int = 64, **flags: bool) -> TaskOutcome:
    return TaskOutcome(name, weight, 1.0, trials_before=0, trials_measured=trials, best_us=best_us, tuning_s=tuning_s,
                       last_round_s=last_round_s, last_round_gain_us=last_round_gain_us, **flags)


def _picked(outcomes: list[TaskOutcome], trials_per_task: int = 512) -> str | None:
    position = next_round(outcomes, trials_per_task)
    return None if position is None else outcomes[position].name


def test_a_round_goes_where_it_is_expected_to_save_the_model_the_most_time_per_second() -> None:
    # called 4 times at 1 ms, tuned 400 s: 4 x 0.8 x 1000 / 400 + 4 x 0.2 x 50 / 100 = 8.4 us/s
    conv = _tuned("conv_called_4_times", 4, 1000.0, tuning_s=400.0, last_round_s=100.0, last_round_gain_us=50.0)
    # a light kernel tuned only briefly still promises more: 0.8 x 300 / 20 = 12 us/s
    light = _tuned("light_kernel", 1, 300.0, tuning_s=20.0, last_round_s=10.0)
    assert _picked([conv, light]) == "light_kernel"
    light.best_us, light.tuning_s = 100.0, 200.0  # tuned 10 times longer: 0.4 us/s
    assert _picked([conv, light]) == "conv_called_4_times"


def test_the_round_a_task_just_gained_in_counts_for_it() -> None:
    stalled = _tuned("stalled", 1, 500.0, tuning_s=100.0, last_round_s=50.0)
    improving = _tuned("improving", 1, 500.0, tuning_s=100.0, last_round_s=50.0, last_round_gain_us=100.0)
    assert _picked([stalled, improving]) == "improving"


def test_a_task_without_a_gain_in_two_rounds_waits_until_every_improving_task_is_done() -> None:
    """Ansor's per-task early stopping, softened: in the 60-minute ResNet-18 build the stage-4 Winograd
    convolution got 256 trials (509 s) after its last gain and none of them gained."""
    heavy = _tuned("heavy_but_stalled", 3, 1070.0, tuning_s=300.0, last_round_s=120.0)
    light = _tuned("light_and_improving", 1, 200.0, tuning_s=100.0, last_round_s=30.0)
    assert _picked([heavy, light]) == "heavy_but_stalled"  # 8.6 against 1.6 us/s
    heavy.trials_since_gain = 112  # two rounds of 64, each done at 7/8
    assert _picked([heavy, light]) == "light_and_improving"
    light.trials_measured = 512  # the improving task is done: the stalled one gets the rest of the budget
    assert _picked([heavy, light]) == "heavy_but_stalled"


def test_a_round_counts_as_a_gain_only_when_it_lowers_the_best_by_1_percent() -> None:
    outcome = _tuned("conv", 1, 1000.0, tuning_s=100.0)
    outcome.finish_round(best_us=995.0, measured=64, seconds=50.0)  # within this machine's noise
    assert (outcome.trials_since_gain, outcome.last_round_gain_us, outcome.last_round_s) == (64, 5.0, 50.0)
    outcome.finish_round(best_us=995.0, measured=40, seconds=30.0)  # a round cut by the budget
    assert outcome.trials_since_gain == 104
    outcome.finish_round(best_us=900.0, measured=64, seconds=50.0)
    assert (outcome.trials_since_gain, outcome.best_us) == (0, 900.0)
    fresh = TaskOutcome("fresh", 1, 1.0, trials_before=0, trials_measured=0, best_us=None)
    fresh.finish_round(best_us=300.0, measured=8, seconds=5.0)  # a first valid record is a gain
    assert (fresh.trials_since_gain, fresh.last_round_gain_us) == (0, 0.0)


def test_tasks_without_a_round_in_this_build_or_a_valid_record_come_first_in_their_order() -> None:
    tuned = _tuned("tuned", 100, 5000.0, tuning_s=10.0)
    resumed = _tuned("resumed_from_an_earlier_build", 1, 10.0, tuning_s=0.0)
    invalid = _tuned("no_valid_record", 1, None, tuning_s=30.0)
    assert _picked([tuned, resumed, invalid]) == "resumed_from_an_earlier_build"
    assert _picked([tuned, invalid, resumed]) == "no_valid_record"


def test_no_round_for_a_task_out_of_trials_schedules_or_budget() -> None:
    done = _tuned("all_trials_measured", 9, 900.0, tuning_s=1.0, trials=512)
    exhausted = _tuned("out_of_schedules", 9, 900.0, tuning_s=1.0, space_exhausted=True)
    cut = _tuned("budget_spent", 9, 900.0, tuning_s=1.0, skipped_for_budget=True)
    assert _picked([done, exhausted, cut]) is None
    assert _picked([done, exhausted, cut, _tuned("open", 1, 1.0, tuning_s=100.0)]) == "open"


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
    assert 0 < outcome.trials_measured < 8  # fewer than the first pass asked for
    assert visits == ["tiny_elementwise"]  # no round after that
    assert [entry["measured"] for entry in store.read_log()] == [outcome.trials_measured]  # no empty batches


def test_the_in_model_comparison_gets_the_ranks_that_fit_its_share_of_the_budget() -> None:
    """At 5 minutes, 4 ranks of a ResNet-18 (about 18 s a model compared on a Zen 4 VM) with the default
    schedules' model and the chosen one would take 108 s of 300: that time tunes instead; at 10 minutes 3 fit.
    On this Zen 5 VM a model compared took 14 s: none at 5 minutes (2 ranks had left 16 s of their share
    unused, the build ended at 282 s), 4 at 10. A model that compiles in a minute compares nothing at 10
    minutes."""
    from edgetune.build.tune import ranks_that_fit
    from edgetune.selection import RankCost

    assert ranks_that_fit(18.0, 300.0) == 1
    assert ranks_that_fit(18.0, 600.0) == 3
    resnet18 = RankCost(compile_s=9.5, run_s=2.0, inference_s=0.006)  # "one compile and run took 11 s"
    assert resnet18.compared_s >= 13.0
    assert ranks_that_fit(resnet18.compared_s, 300.0) == 1 and ranks_that_fit(resnet18.compared_s, 600.0) == 4
    assert ranks_that_fit(60.0, 600.0) == 1
    assert ranks_that_fit(0.0, 60.0) > 64  # instant compiles: the recipe's in_model_candidates bounds it


def test_the_stages_after_the_comparison_keep_about_what_they_took_in_real_builds() -> None:
    """What the final stages took in real builds on a Zen 3 VM, the untuned model's timing left out (the reserve
    times it now), against what is kept for them from one compile and run of the model: a 4-minute ResNet-18,
    nothing compared, so the model to ship compiled after tuning (18 s in the reserve beside the untuned
    compile, 13-15 s alone), 23 ms a call, 61 MB, run in edgetune's pool: 39-41 s; a 10-minute MobileNet-V2
    after its comparison (8 ms, 15 MB, pooled): 19 s. Guessing the untuned model's time as 200x the tuned one's
    (an AVX-512 VM's ratio; 28-61x on this one) had kept 57-66 s for that ResNet-18, which ended 2-8% early."""
    from edgetune.build.tune import finish_seconds
    from edgetune.selection import RankCost

    def kept(compile_s: float, call_ms: float, library_mb: float, compiles: int = 0, ways: int = 2,
             pooled: bool = True) -> float:
        return finish_seconds(RankCost(compile_s, 1.0, call_ms / 1e3), compiles, library_mb * 1e6, ways,
                              pooled=pooled)

    assert 39 <= kept(18.0, 23.0, 61.0, compiles=1) <= 48
    assert 18 <= kept(17.0, 8.2, 15.0) <= 26
    assert kept(0.05, 0.01, 0.1) < 15  # a tiny model: 0.2 s of runs per timing
    # verification runs a pooled artifact in a process of its own (it starts the pool there)
    assert kept(17.0, 8.2, 15.0) - kept(17.0, 8.2, 15.0, pooled=False) == pytest.approx(2.5)
    # each model still to compile after the comparison adds a compile
    assert kept(25.0, 12.0, 40.0, compiles=2) == kept(25.0, 12.0, 40.0) + 50.0
    # a recipe that says how the threads wait (package.thread_wait) times the model one way, not both, and not
    # beside a busy process (3 rounds and the busy one of 1.75 s a timing: 9 s)
    assert kept(25.0, 12.0, 40.0) - 11 < kept(25.0, 12.0, 40.0, ways=1) < kept(25.0, 12.0, 40.0) - 6


def test_beside_other_programs_the_final_timings_of_a_fast_model_are_kept_at_their_full_length() -> None:
    """A 3-minute build of an exported transformer encoder beside a busy loop timed its reserve's call on the one
    thread the loop left (about 0.5 ms): each of the final stage's timings was sized at 1000 such calls (0.5 s),
    but they ran on both threads beside the loop (1.3 ms sleeping, 100 ms spinning) and took their full second:
    27 s of final stages where 20 s were kept, and the build ended 12 s (6.7%) after its budget."""
    from edgetune.build.tune import finish_seconds
    from edgetune.selection import RankCost

    cost = RankCost(4.5, 0.05, 0.5e-3)  # "one compile and run of the model took 6 s (run on 1 of 2 threads)"
    alone, shared = finish_seconds(cost, 1, 2e6), finish_seconds(cost, 1, 2e6, cores_shared=True)
    # the build kept 20 s; its final stages took 27 s, the untuned model's timing (about 2 s) among them, which
    # the reserve takes now
    assert alone < 22 and 24 <= shared <= 30
    slow = RankCost(5.0, 0.5, 20e-3)  # a model whose timings run their full second anyway keeps what it kept
    assert finish_seconds(slow, 1, 2e6, cores_shared=True) == finish_seconds(slow, 1, 2e6)


def test_a_budget_too_short_for_the_stages_after_tuning_says_by_how_much_the_build_will_overrun_it() -> None:
    """At most half a budget is kept for what follows the tuning. Two-minute builds of a ResNet-18 and a
    MobileNet-V2 on an AVX2 VM needed more (the final compile alone took about 30 s) and ended 45-68 s after
    their 120 s, saying only that 60 s were kept. Within 5% of the budget nothing is said."""
    from edgetune.build.tune import overrun_warning, split_reserve

    assert split_reserve(20.0, 40.0, 600.0) == (60.0, 40.0)  # all of it fits
    kept, finish_kept = split_reserve(0.0, 100.0, 120.0)
    assert (kept, finish_kept) == (60.0, 60.0)
    warning = overrun_warning(100.0, finish_kept, 120.0)
    assert warning is not None and "at least 40 s after its budget" in warning and "4 minutes or more" in warning
    kept, finish_kept = split_reserve(30.0, 90.0, 200.0)  # shared in proportion: 25 s and 75 s
    assert (kept, finish_kept) == (100.0, 75.0) and "15 s after" in overrun_warning(90.0, finish_kept, 200.0)
    assert overrun_warning(40.0, 40.0, 600.0) is None
    assert overrun_warning(64.0, 60.0, 120.0) is None  # 4 s over 120: within 5%
    nothing_compared = 24.142857142857142  # where finish * kept / finish rounds above kept: the build said "-0 s"
    kept, finish_kept = split_reserve(0.0, nothing_compared, 600.0)
    assert finish_kept == kept == nothing_compared


def test_a_round_sends_its_next_batch_only_if_half_of_it_fits_before_the_deadline() -> None:
    """A Winograd convolution's last round of a 6-minute build: its first batch of 8 took 15 s, and its second,
    started with 4 s left, 15 s more. The first batch of a round is sent (no pace yet); each next one only if
    at least half of it, at the last batch's pace per candidate, ends before the deadline."""
    from edgetune.tuning.search_strategy.deadline import BatchPace, expected_batch_s

    pace = BatchPace(deadline=140.0, trials_left=24, per_iter=16)
    assert pace.next_fits(100.0)  # 40 s left
    pace.sent(100.0, 8)
    assert pace.next_fits(115.0)  # 8 in 15 s: the next 16 (the round's 24 less 8) take 30 s; half fits in 25
    pace.sent(115.0, 8)
    assert pace.next_fits(130.0)  # 8 left to send take 15 s, 10 s left: more than half fits
    pace.sent(130.0, 8)
    assert pace.next_fits(150.0)  # the round's trials are all sent: nothing more to cut
    late = BatchPace(deadline=140.0, trials_left=24, per_iter=16)
    assert late.next_fits(135.0)  # a round started with 5 s left: its first batch runs
    late.sent(135.0, 8)
    assert not late.next_fits(149.0)
    assert expected_batch_s(15.0, 8, trials_left=4, per_iter=16) == 7.5
    assert expected_batch_s(15.0, 8, trials_left=40, per_iter=16) == 30.0


def test_a_real_round_past_its_deadline_stops_after_its_first_batch(tmp_path: Path) -> None:
    """Through MetaSchedule's own loop: the round of 24 whose deadline passed during its first batch (8, as
    draft-verify's rounds start) ends there, and its records are the batch's."""
    import time

    from tvm.s_tir import meta_schedule as ms

    from edgetune.profiles import load_profile
    from edgetune.tuning.cost_model.ranking import RankingCostModel
    from edgetune.tuning.intrinsics import register_tensor_intrinsics
    from edgetune.tuning.search_strategy.deadline import EndsByDeadline, RoundCut
    from edgetune.tuning.search_strategy.draft_verify import FIRST_BATCHES, DraftVerifySearch
    from edgetune.tuning.tune import local_builder_runner

    target, cut = load_profile("host").tvm_target(), RoundCut()
    register_tensor_intrinsics(target)
    search = EndsByDeadline(DraftVerifySearch(load_profile("host").hardware, "cpu", population=256, verify=16),
                            time.monotonic(), cut)
    context = ms.TuneContext(mod=_task("doubled", 4096, 1).mod, target=target, space_generator="post-order-apply",
                             search_strategy=search, task_name="doubled", rand_state=3, num_threads=2)
    builder, runner = local_builder_runner(2, "cpu")
    database = ms.database.MemoryDatabase()
    try:
        ms.tune_tasks(tasks=[context], task_weights=[1.0], work_dir=str(tmp_path), max_trials_global=24,
                      max_trials_per_task=24, num_trials_per_iter=24, builder=builder, runner=runner,
                      database=database, cost_model=RankingCostModel(num_threads=2), task_scheduler="round-robin")
    finally:
        builder.close()
        runner.close()
    assert cut.cut
    assert 0 < len(database.get_all_tuning_records()) <= FIRST_BATCHES[0]
