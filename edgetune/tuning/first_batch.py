"""Every task's first schedules, built in one batch and timed before any search starts.

A task's first round measures its first schedules after every earlier task's rounds: a ResNet-18's 14 tasks
had each a schedule only after 41-48 s of tuning from scratch, its first pass, one task's builds at a time
and a round's fixed cost 14 times over. Built as one batch, the builds share every worker, and the whole
model has a schedule for every kernel when the batch ends: the curve starts there, and with it the time to
beat the reference (15-19 s from scratch).

Each task gets one of:
- with siblings' records, the siblings' best schedule of the task (the first that keeps this device's cores
  busy); the rest of its seeds wait for its first round (`SeededSearch`, which counts this batch's seed as
  taken), and the prior is trained after the batch. The whole model runs at the siblings' quality after it;
- else, with draft-verify, the analyzer's best drafts (`DraftFn`): what the task's first round would measure
  first. This covers a scratch build and the tasks no sibling schedule covers (the sibling chose another
  algorithm for them: Winograd there, direct here).
The stock evolutionary search has no analyzer to draft with: its tasks without a seed start with rounds.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult
from tvm.s_tir.meta_schedule.database import TuningRecord
from tvm.s_tir.meta_schedule.runner import RunnerInput, RunnerResult
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

from edgetune.tuning.analyzer.tir import BALANCED, core_balance, parallel_extent
from edgetune.tuning.builder import STRAGGLER_ERROR
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.measurements import FAILED, WatchesTimingNoise, mean_seconds, measure_candidate
from edgetune.tuning.slow_windows import TimesInWindows
from edgetune.tuning.task_scheduler import TaskOutcome
from edgetune.tuning.tasks import TuningTask
from edgetune.tuning.transfer.siblings import SiblingSchedule, TransferStats, tuning_context

_FAILED_RUN_SECS = [1e10]
"""What MetaSchedule records for a candidate that failed to build or run (its AddToDatabase callback)."""


DraftFn = Callable[[list[int]], list[tuple[int, ms.TuneContext, list[MeasureCandidate]]]]
"""The first drafts of the tasks at these positions (those without a sibling's seed): (position, context, drafts)
of each task drafted, in order; a task the analyzer could not draft is left out."""


@dataclass
class FirstMeasured:
    """One of a task's first schedules as the batch measured it: what its cost model learns once it exists."""

    position: int  # the task's position in the tuning's task list
    context: ms.TuneContext
    candidate: MeasureCandidate
    result: RunnerResult

    @property
    def seconds(self) -> float:
        return mean_seconds(self.result.run_secs) if self.result.error_msg is None else FAILED


def first_seeds(tasks: list[TuningTask], outcomes: list[TaskOutcome], seeds: dict[int, list[SiblingSchedule]],
                target: tvm.target.Target, cores: int) -> list[tuple[int, ms.TuneContext, MeasureCandidate]]:
    """(position, context, candidate) of each task's first seed, for each task with seeds waiting.

    The first seed is the siblings' best that replays and keeps this device's cores evenly busy
    (`first_balanced`). It is moved to the front of the task's seeds, so `SeededSearch` measures the others
    after it (and drops those that leave more cores idle than another)."""
    chosen = []
    for position, (task, outcome) in enumerate(zip(tasks, outcomes)):
        task_seeds = seeds.get(tvm_ffi.structural_hash(task.mod), [])
        if outcome.sibling_seeds == 0 or not task_seeds:
            continue
        context = tuning_context(task, target, cores)
        postprocs = list(context.space_generator.postprocs)
        replayed = ((i, seed.replay(task.mod, postprocs, seed=1)) for i, seed in enumerate(task_seeds))
        first = first_balanced(((i, schedule) for i, schedule in replayed if schedule is not None), cores)
        if first is not None:
            i, schedule = first
            task_seeds.insert(0, task_seeds.pop(i))
            chosen.append((position, context, measure_candidate(schedule)))
    return chosen


def first_balanced(schedules: Iterable[tuple[int, Schedule]], cores: int) -> tuple[int, Schedule] | None:
    """The first of the (rank, schedule) pairs whose parallel loop keeps the `cores` at least BALANCED busy
    (`core_balance`), else the best balanced of them (the better ranked on a tie); None if there are none.

    A sibling with fewer cores ranks its schedules without regard to how they split over this device's:
    - a 1-core sibling's best schedule of a convolution (no parallel loop) ran on one of this machine's two cores
      at twice the time of its next seed;
    - of its four best of ResNet-18's 56x56 Winograd product, the first two are single-threaded and the third
      (3 parallel iterations: 2 on one core, 1 on the other) ran at 325 us on two cores, where the fourth (42
      iterations) ran at 200 us; the third also took 4.3 s to build, against 0.2 s, and held up the whole batch."""
    seen = []  # (rank, schedule, balance)
    for rank, schedule in schedules:
        seen.append((rank, schedule, core_balance(parallel_extent(schedule.mod), cores)))
        if seen[-1][2] >= BALANCED:
            break
    if not seen:
        return None
    rank, schedule, _ = max(seen, key=lambda s: (s[2], -s[0]))
    return rank, schedule


def measure_first_batch(tasks: list[TuningTask], outcomes: list[TaskOutcome], target: tvm.target.Target,
                        store: RecordStore, builder: ms.builder.Builder, runner: ms.runner.Runner,
                        seeds: dict[int, list[SiblingSchedule]], stats: TransferStats | None, cores: int,
                        on_measured: Callable[[FirstMeasured], None], drafts: DraftFn | None = None) -> None:
    """Every task's first seed (`seeds`: none without siblings) and the `drafts` of the tasks without a
    schedule or a seed: built together, timed one by one, each committed to the store (a failed one as
    MetaSchedule records it), counted into its task's outcome (a seed into the transfer's `stats` too), and
    handed to `on_measured` (which makes it durable) before the next is timed."""
    chosen = first_seeds(tasks, outcomes, seeds, target, cores)
    if drafts is not None:
        chosen += _drafts_of_the_rest(outcomes, drafts)
    if not chosen:
        return
    built = builder.build([BuilderInput(candidate.sch.mod, target) for _, _, candidate in chosen])
    try:
        results = _results(runner, chosen, built, outcomes, target)
        for (position, context, candidate), build, result in zip(chosen, built, results):
            outcome = outcomes[position]
            outcome.builds_cut += (build.error_msg or "").startswith(STRAGGLER_ERROR)
            measured = FirstMeasured(position, context, candidate, result)
            _commit(store, tasks[position], target, candidate, result)
            _count(outcome, tasks[position].name, measured.seconds, stats if outcome.sibling_seeds else None)
            on_measured(measured)
    finally:  # also when the runner raised (a device lost)
        for build in built:
            if build.error_msg is None:  # as MetaSchedule's RemoveBuildArtifact callback does
                shutil.rmtree(os.path.dirname(build.artifact_path), ignore_errors=True)


def _results(runner: ms.runner.Runner, chosen: list[tuple[int, ms.TuneContext, MeasureCandidate]],
             built: list[BuilderResult], outcomes: list[TaskOutcome],
             target: tvm.target.Target) -> Iterator[RunnerResult]:
    """Each chosen candidate's result, in order: a failed build's error, else its timing. A runner that times
    beside a reference kernel (`TimesInWindows`) gets all of them at once, so a candidate timed in a slow window
    is timed again even when the window shows only later in the batch; another runner times them one by one,
    each made durable before the next is timed."""
    inputs = {i: RunnerInput(build.artifact_path, _device_type(target), chosen[i][2].args_info)
              for i, build in enumerate(built) if build.error_msg is None}
    timed: dict[int, RunnerResult] = {}
    if isinstance(runner, TimesInWindows):
        order = list(inputs)

        def watch(j: int) -> None:
            runner.noise.watch(outcomes[chosen[order[j]][0]].timings, None)
        timed = dict(zip(order, runner.time_results([inputs[i] for i in order], before_each=watch)))
    for i, build in enumerate(built):
        if build.error_msg is not None:
            yield RunnerResult(None, build.error_msg)
        else:
            yield timed[i] if i in timed else _timed(runner, outcomes[chosen[i][0]], inputs[i])


def _drafts_of_the_rest(outcomes: list[TaskOutcome], drafts: DraftFn) -> list[tuple[int, ms.TuneContext,
                                                                                   MeasureCandidate]]:
    """The drafts of each task with no schedule yet and no sibling seed waiting (so a candidate of the batch is
    a sibling's seed exactly when its task has seeds waiting)."""
    rest = [p for p, outcome in enumerate(outcomes) if outcome.best_us is None and outcome.sibling_seeds == 0]
    return [(position, context, candidate) for position, context, candidates in drafts(rest)
            for candidate in candidates]


def _count(outcome: TaskOutcome, task: str, seconds: float, stats: TransferStats | None) -> None:
    """A candidate measured: one trial of the task in this build; a sibling's seed (`stats`) one of its seeds
    taken."""
    outcome.trials_measured += 1
    if stats is not None:
        stats.seeds_taken[task] = stats.seeds_taken.get(task, 0) + 1
        if seconds < stats.seed_best.get(task, FAILED):
            stats.seed_best[task] = seconds
    if seconds < FAILED and (outcome.best_us is None or seconds * 1e6 < outcome.best_us):
        outcome.best_us = seconds * 1e6


def _device_type(target: tvm.target.Target) -> str:
    """What a runner's input names the device by ("cpu" for an LLVM target), as MetaSchedule's loop sends it."""
    return tvm.runtime.device(target.get_target_device_type(), 0).type


def _timed(runner: ms.runner.Runner, outcome: TaskOutcome, runner_input: RunnerInput) -> RunnerResult:
    """One candidate timed, its disturbed timings counted into its own task's outcome."""
    if isinstance(runner, WatchesTimingNoise):
        runner.noise.watch(outcome.timings, None)
    (future,) = runner.run([runner_input])
    return future.result()


def _commit(store: RecordStore, task: TuningTask, target: tvm.target.Target, candidate: MeasureCandidate,
            result: RunnerResult) -> None:
    run_secs = result.run_secs if result.error_msg is None and result.run_secs else _FAILED_RUN_SECS
    workload = store.database.commit_workload(task.mod)
    store.database.commit_tuning_record(TuningRecord(candidate.sch.trace, workload, [float(s) for s in run_secs],
                                                     target, candidate.args_info))
