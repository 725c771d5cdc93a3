"""Stage: tune. Extract the target's tasks and tune them on its device; what the target's siblings
measured warm-starts it. Produces the target's result with its tuning summary."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetune.build.context import Event, TargetBuild
from edgetune.frontend.onnx import fuse_for_tuning
from edgetune.isolated import LOADED_APART_BYTES
from edgetune.machine_load import BUSY_START_S
from edgetune.report.summary import TargetResult
from edgetune.runtime import FULL_TIMING_CALL_S, SPIN_DOWN_S, TIMING_ROUNDS, thread_wait_ways, time_model_seconds
from edgetune.tuning.builder import STRAGGLER_FACTOR
from edgetune.tuning.measurements import NoiseCounts
from edgetune.tuning.shards import tune_in_shards
from edgetune.tuning.tasks import extract_tasks
from edgetune.tuning.transfer.siblings import load_sibling_seeds
from edgetune.tuning.tune import UNBOUNDED_TRIALS, TuningPlan, TuningResult, tune

if TYPE_CHECKING:
    from edgetune.selection import RankCost


def tune_stage(ctx: TargetBuild) -> TargetResult:
    """Tune the target's tasks (or only count them with trials_per_task: 0) and summarise each."""
    recipe, profile = ctx.recipe, ctx.profile
    ctx.say(f"extracting tasks for {profile.name} ({_describe_target(ctx)})")
    tasks = extract_tasks(fuse_for_tuning(ctx.relax_mod, ctx.tvm_target, ctx.winograd), ctx.tvm_target)
    tuned_tasks = tasks[: recipe.tuning.max_tasks] if recipe.tuning.max_tasks else tasks
    trials = recipe.tuning.trials_per_task
    sharded = _splits_tasks(ctx, tuned_tasks)
    siblings, started = None, time.monotonic()  # the tuning's clock counts the siblings' reading
    if ctx.sibling_stores and recipe.tuning.transfer != "off" and trials != 0 and not sharded:
        siblings = load_sibling_seeds({n: s.directory for n, s in ctx.sibling_stores.items()}, tuned_tasks)
        seeded = sum(1 for traces in siblings.seeds.values() if traces)
        ctx.say(f"transfer from {', '.join(ctx.sibling_stores)}: {sum(map(len, siblings.seeds.values()))} of "
                f"their schedules to re-measure first, the best of each of {seeded} tasks in one batch")
    plan = TuningPlan(
        trials_per_task=UNBOUNDED_TRIALS if trials is None else trials, time_budget_s=_tuning_budget_s(ctx),
        search=recipe.tuning.search, seed=recipe.tuning.seed, cores=profile.hardware.cores or 1,
        hardware=profile.hardware, device=profile.device, isa=profile.isa, siblings=siblings,
        transfer=recipe.tuning.transfer, keep_for_later=_budget_reserve(ctx), runs_on=ctx.device, started=started,
    )
    if trials == 0:
        ctx.say(f"{len(tasks)} tasks; no tuning (trials_per_task: 0)")
    else:
        where = "" if ctx.device.runs_here else f", measured on {ctx.device.where}"
        ctx.say(f"{len(tasks)} tasks, tuning {len(tuned_tasks)} with {plan.search} search{where}")
    if sharded:
        sibling_dirs = {} if recipe.tuning.transfer == "off" else {
            n: s.directory for n, s in ctx.sibling_stores.items()}
        tuning = tune_in_shards(tuned_tasks, ctx.tvm_target, ctx.store, plan, ctx.task_pool, sibling_dirs,
                                ctx.work_dir / "logs", ctx.say)
    else:
        tuning = tune(tuned_tasks, ctx.tvm_target, ctx.store, plan, lambda p: ctx.emit(Event(ctx.name, "", p)),
                      logs_dir=ctx.work_dir / "logs")
    summary = [_task_summary(t, recipe.tuning.search) for t in tuning.tasks]
    stopped_by = _stopped_by(tuning.tasks, plan.trials_per_task) if trials != 0 else []
    if stopped_by:
        ctx.say(f"tuning ended by: {', '.join(stopped_by)} ({tuning.trials_measured} trials in {tuning.wall_s:.0f} s)")
    for t in tuning.failed:
        kept = "its best schedule so far" if t.best_us is not None else "its untuned schedule"
        ctx.say(f"warning: tuning of task {t.name} failed ({t.tuning_failed}); it keeps {kept}")
    noise = NoiseCounts.total(t.timings for t in tuning.tasks)
    builds_cut = sum(t.builds_cut for t in tuning.tasks)
    if builds_cut:
        ctx.say(f"builds cut short: {builds_cut} (each ran over {STRAGGLER_FACTOR:g} times its batch's median "
                "build)")
    return TargetResult(
        ctx.name,
        trials_measured=tuning.trials_measured,
        trials_total=sum(t["trials"] for t in summary),
        tuning_s=tuning.wall_s,
        tuning_stopped_by=stopped_by,
        kept_for_selection_s=tuning.kept_s,
        tuning_phases_s={phase: round(seconds, 1) for phase, seconds in tuning.phases_s.items()},
        tuning_curve=tuning.curve,
        tasks=summary,
        tasks_total=len(tasks),
        records=_display_store(ctx.store.directory, ctx.build_dir),
        transfer=_transfer_summary(tuning, ctx.sibling_stores, recipe.tuning.transfer),
        tuning_failed=[f"{t.name}: {t.tuning_failed}" for t in tuning.failed],
        timings_disturbed=noise.disturbed,
        timings_remeasured=noise.remeasured,
        timings_still_disturbed=noise.still_disturbed,
        timings_on_fewer_threads=noise.on_fewer_threads,
        timings_in_slow_windows=noise.slow_window,
        timings_retimed_quiet=noise.slow_window_retimed,
        timings_still_slow=noise.slow_window_still,
        builds_cut=builds_cut,
    )


def _stopped_by(outcomes: list, trials_per_task: int) -> list[str]:
    """Each bound that ended some task's tuning (TargetResult.tuning_stopped_by), in a fixed order."""
    reasons = {
        "time_budget": any(o.skipped_for_budget for o in outcomes),
        "trials_per_task": any(o.trials_before + o.trials_measured >= trials_per_task for o in outcomes),
        "search_space": any(o.space_exhausted for o in outcomes),
        "failed": any(o.tuning_failed for o in outcomes),
    }
    return [reason for reason, ended in reasons.items() if ended]


def _splits_tasks(ctx: TargetBuild, tasks: list) -> bool:
    """Whether the target's tasks are tuned in shards on the release's workers: only for a device that
    every worker reaches (an RPC tracker key), never for this machine's CPU, whose candidates must be timed
    on it one at a time (and a worker on another node would time its own CPU)."""
    pool = ctx.task_pool
    if pool is None or pool.size < 2 or len(tasks) < 2 or ctx.recipe.tuning.trials_per_task == 0:
        return False
    if ctx.device.runs_here:
        ctx.say(f"its tasks are tuned by this worker alone: candidates for {ctx.device.where} are timed on "
                "it, one at a time")
        return False
    return True


def _task_summary(task, search: str) -> dict[str, Any]:
    return {
        "name": task.name,
        "weight": task.weight,
        "flops": task.flops,
        "trials": task.trials_before + task.trials_measured,
        "trials_measured_now": task.trials_measured,
        "tuning_s": round(task.tuning_s, 1),  # this build's seconds on the task, all rounds (builds and runs)
        "best_us": task.best_us,
        "gflops": task.gflops,
        "skipped_for_budget": task.skipped_for_budget,
        "space_exhausted": task.space_exhausted,
        "candidates": asdict(task.search) if search == "draft-verify" else None,
        "search_fallback": task.search.fallback,
        "tuning_failed": task.tuning_failed,
        "timings_disturbed": task.timings.disturbed,
        "timings_remeasured": task.timings.remeasured,
        "timings_on_fewer_threads": task.timings.on_fewer_threads,
        "timings_in_slow_windows": task.timings.slow_window,
        "timings_retimed_quiet": task.timings.slow_window_retimed,
        "builds_cut": task.builds_cut,
    }


def _describe_target(ctx: TargetBuild) -> str:
    spec = ctx.profile.target
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k != "kind") or spec["kind"]


def _display_store(directory: Path, build_dir: Path) -> str:
    """The store's path relative to the build directory when inside it, so a moved build still finds it."""
    return str(directory.relative_to(build_dir)) if directory.is_relative_to(build_dir) else str(directory)


def _transfer_summary(tuning: TuningResult, sibling_stores: dict, mode: str) -> dict[str, Any] | None:
    """Which siblings' records were used and what came of them, per target."""
    if not sibling_stores:
        return None
    stats = tuning.transfer
    if stats is None:
        why = "transfer: off" if mode == "off" else "no tuning in this build, or no sibling records of these tasks"
        return {"sources": list(sibling_stores), "used": False, "why_not": why}
    best = {t.name: t.best_us for t in tuning.tasks}
    return {
        "sources": stats.sources,
        "used": True,
        "mode": stats.mode,
        "sibling_records": stats.sibling_records,
        "seeds_measured": stats.seeds_measured,
        "tasks_best_from_sibling": sorted(
            name for name, seconds in stats.seed_best.items()
            if best.get(name) is not None and seconds * 1e6 <= best[name] * (1 + 1e-9)
        ),
        "guard_fell_back": sorted(stats.distrusted),
    }


_TIMING_OVERHEAD_S = 0.5
"""A timing's library load and its process's round trip, beside the model's calls (runtime.time_model_seconds)."""
_PROCESS_S = 2.5
"""A fresh process that imports TVM: the tuned model's timers (one per way its threads wait, started together),
verification's run of a library larger than LOADED_APART_BYTES or of one in edgetune's thread pool."""
_LIBRARY_PER_WEIGHT_BYTE = 1.3
"""An exported library's size over its model's weights (code and pre-packed copies): ResNet-18 1.28
(59.9 MB: loaded in the build's process), ResNet-50 1.19; a small model's code weighs more (GoogLeNet 1.49,
38.7 MB), far under LOADED_APART_BYTES."""
_ARCHIVE_BYTES_PER_S = 30e6
"""Verification's checksums and the artifact's gzip archive, per second, by the library's bytes (a ResNet-50's
115 MB: about 4 s)."""


def finish_seconds(cost: RankCost, compiles: int, library_bytes: float, thread_wait_ways: int = 2,
                   cores_shared: bool = False, pooled: bool = False) -> float:
    """What the stages after the in-model comparison take, step by step as they run (build/measure.py,
    build/verify.py), from one compile and run of the model measured here: compile what is still to compile,
    time the tuned model in its timers' processes and the reference in turns (and each way once beside a busy
    process), run and archive the artifact (`pooled`: in a process of its own, which starts edgetune's thread
    pool). The untuned model is not among them: the reserve times it (`_budget_reserve`). Charging a fresh
    process per timing and 15 s for any untuned model that runs a second or more had kept 55 s for a ResNet-18
    whose stages took 26 s, and its 5-minute builds ended 8-15% early. `cores_shared`: the call was timed on the
    cores other programs left, and the final timings run on all the target's threads beside them, where a fast
    model's calls slow down many times (a transformer encoder: 0.5 ms on the free core, 1.3 ms sleeping and
    100 ms spinning on both), so each timing is charged its full length, not the shorter one of a thousand fast
    calls."""
    call_s = max(cost.inference_s, FULL_TIMING_CALL_S) if cores_shared else cost.inference_s
    timing_s = time_model_seconds(call_s) + _TIMING_OVERHEAD_S
    ways_s = thread_wait_ways * (timing_s + SPIN_DOWN_S)  # the tuned model timed once each way
    rounds_s = _PROCESS_S + TIMING_ROUNDS * (ways_s + timing_s)
    if thread_wait_ways > 1:  # and once each way beside a low-priority busy process (build/measure.py)
        rounds_s += BUSY_START_S + ways_s
    apart_s = _PROCESS_S if pooled or library_bytes > LOADED_APART_BYTES else 0.0
    verify_s = apart_s + call_s + library_bytes / _ARCHIVE_BYTES_PER_S
    return compiles * cost.compile_s + rounds_s + verify_s


def split_reserve(compare_s: float, finish_s: float, budget_s: float) -> tuple[float, float]:
    """(seconds the tuning keeps, of them for the final compile, timing and packaging): what comparing schedules
    inside the model (`compare_s`) and those stages (`finish_s`) take, at most half the budget, shared between
    them in proportion."""
    kept = min(compare_s + finish_s, budget_s / 2)
    return kept, min(kept, finish_s * kept / max(compare_s + finish_s, 1e-9))  # never more: rounding said "-0 s"


def overrun_warning(finish_s: float, finish_kept_s: float, budget_s: float) -> str | None:
    """What the build says when the stages after tuning need more of the budget than is kept for them (more than
    half of it): by how much at least it will end after its budget, and the budget that holds them. None within
    _BUDGET_TOLERANCE. Two-minute builds of a ResNet-18 and a MobileNet-V2 on an AVX2 VM ended 45-68 s after
    their 120 s, and said only that 60 s were kept. At least: a budget this short also gives the tasks' first
    rounds more than its share (one such ResNet-18 build was told 21 s, and ended 44 s after its budget)."""
    over_s = finish_s - finish_kept_s
    if over_s <= _BUDGET_TOLERANCE * budget_s:
        return None
    holding_min = math.ceil(2 * finish_s / 60)
    return (f"warning: compiling, timing and packaging this model take about {finish_s:.0f} s, more than the "
            f"{finish_kept_s:.0f} s the {budget_s:.0f}-s budget keeps for them: the build will end at least "
            f"{over_s:.0f} s after its budget (a budget of {holding_min} minutes or more holds them)")


_BUDGET_TOLERANCE = 0.05
"""A budget is kept within this share of it (issue 29: the whole command within +-5%)."""


_COMPARE_SHARE = 0.15
"""At most this share of a budget goes to comparing schedules inside the model (one compile and run per rank,
one for the default schedules, and one for the model of the kernels' choices). Side by side on ResNet-18 at
5 minutes (benchmarks/variants.py, 3 seeds), the tuning time that 4 ranks took (about 80 s of 300) made the
model 1.13x faster than the comparison did."""


def ranks_that_fit(compared_s: float, budget_s: float) -> int:
    """Candidate ranks whose in-model comparison, with the default schedules' model and the chosen one, fits
    _COMPARE_SHARE of the budget, `compared_s` a model (below 2 nothing is compared: the tuner's best is the
    only candidate)."""
    return max(1, int(_COMPARE_SHARE * budget_s / max(compared_s, 1e-3)) - 2)


def _tuning_budget_s(ctx: TargetBuild) -> float | None:
    """What is left of the target's budget when tuning starts: the import and extraction came out of it."""
    left = ctx.budget_left_s()
    return max(left, 0.0) if left is not None else None


def _budget_reserve(ctx: TargetBuild):
    """The tuner's call for the seconds of its budget to keep for what follows it: comparing schedules inside
    the model (build/compile.py), one compile and run of the model per candidate rank and a run of the default
    schedules', then the final compile, timing, packaging and verification (`finish_seconds`); at most half
    the budget. One compile and run is measured when the tuner asks, with its best so far, and the untuned
    model is compiled apart beside it (build/untuned.py), so no later stage compiles it. None
    for a device measured elsewhere, where the model cannot be run here."""
    if ctx.budget_s is None or not ctx.device.runs_here:
        return None

    def reserve() -> float:
        import tvm

        from edgetune.machine_load import on_free_cores
        from edgetune.selection import rank_cost

        inputs = ctx.sample_list(ctx.model.sample_inputs())
        # compiled apart beside this compile (a small model, or short of memory: here, before the timing);
        # done before any timing
        ctx.untuned.start()
        # timed on the cores the comparison will have: timed on both threads beside a busy loop, a ResNet-18's
        # reserve said 237 s for the stages after tuning, which took 77 s
        with on_free_cores(ctx.profile.cpu_threads) as threads:
            cost = rank_cost(ctx.relax_mod, ctx.tvm_target, ctx.store.database, inputs,
                             tvm.device(ctx.profile.device, 0), ctx.winograd, before_timing=ctx.untuned.library,
                             compiled_beside=ctx.untuned.compiling_apart)
        # timed now, where it is ready, and reported by the measure stage: a guess of its time from the tuned
        # model's (200x on an AVX-512 VM, 28-61x on a Zen 3 one) had kept 9 s too many for a ResNet-18
        ctx.untuned_latency_ms(inputs)
        one_rank = cost.total_s
        cores_shared = threads is not None and threads < ctx.profile.cpu_threads
        ctx.ranks_that_fit = ranks_that_fit(cost.compared_s, ctx.budget_s)
        # the tuner's best, then the default schedules' model (compiled already), the other ranks and the chosen one
        compare = one_rank + cost.default_s + ctx.candidates * cost.compared_s if ctx.candidates > 1 else 0.0
        # the comparison compiles the one to ship; without it the later stages do
        finish = finish_seconds(cost, compiles=0 if ctx.candidates > 1 else 1,
                                library_bytes=ctx.weight_bytes * _LIBRARY_PER_WEIGHT_BYTE,
                                thread_wait_ways=len(thread_wait_ways(ctx.recipe.package.thread_wait,
                                                                     ctx.times_thread_pool)),
                                cores_shared=cores_shared, pooled=ctx.times_thread_pool)
        kept, ctx.finish_reserve_s = split_reserve(compare, finish, ctx.budget_s)
        narrowed = (f" (run on {threads} of {ctx.profile.cpu_threads} threads: other programs held cores)"
                    if cores_shared else "")
        ctx.say(f"one compile and run of the model took {one_rank:.0f} s{narrowed}: the tuning budget keeps "
                f"{kept:.0f} s, {kept - ctx.finish_reserve_s:.0f} s to compare each kernel's best schedules and its default "
                f"inside the model and {ctx.finish_reserve_s:.0f} s for the final compile, timing and packaging")
        if (overrun := overrun_warning(finish, ctx.finish_reserve_s, ctx.budget_s)) is not None:
            ctx.say(overrun)
        if ctx.comparison_cut_by_budget:
            compared = f"{ctx.candidates} best schedules" if ctx.candidates > 1 else "no schedules"
            ctx.say(f"comparing {ctx.recipe.tuning.in_model_candidates} schedules per kernel inside the model "
                    f"would take more than {_COMPARE_SHARE:.0%} of the budget: {compared} compared, the rest of "
                    "that time tunes")
        return kept

    return reserve
