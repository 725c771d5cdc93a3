"""Tune every task of one target with MetaSchedule, resumably.

Each task gets `trials_per_task` measurements in total across builds: what the target's record
store already holds counts, so re-running a finished build measures nothing. One cost model is
shared by all tasks of a target (as in `tune_tasks`), and tasks run one after another, heaviest
first, so a time budget is spent where the model spends its time.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import MeasureCallback, PyMeasureCallback

from edgetune.errors import EdgetuneError
from edgetune.tuning.builder import create_builder
from edgetune.tuning.records import RecordStore
from edgetune.tuning.tasks import TuningTask

_MAX_TRIALS_PER_ROUND = 32


@dataclass(frozen=True)
class TuningPlan:
    trials_per_task: int
    time_budget_s: float | None
    search: str
    seed: int
    cores: int


@dataclass
class TaskProgress:
    """What a progress display needs; sent after every measured batch and at each task's start/end."""

    index: int  # 1-based
    total: int
    task: str
    trials_done: int
    trials_planned: int
    best_us: float | None
    elapsed_s: float  # since tuning of this target began


@dataclass
class TaskOutcome:
    name: str
    weight: int
    flops: float
    trials_before: int  # records the store held when this build started
    trials_measured: int  # measured by this build
    best_us: float | None
    skipped_for_budget: bool = False
    tuning_s: float = 0.0

    @property
    def gflops(self) -> float | None:
        return self.flops / self.best_us / 1e3 if self.best_us else None


@dataclass
class TuningResult:
    tasks: list[TaskOutcome] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def trials_measured(self) -> int:
        return sum(t.trials_measured for t in self.tasks)


ProgressFn = Callable[[TaskProgress], None]


class TuningInterrupted(EdgetuneError):
    """Ctrl-C: tuning stopped after the batch in flight was measured and committed."""

    exit_code = 130


@contextmanager
def _stop_requests() -> Iterator[threading.Event]:
    """Turn the first Ctrl-C into a request to stop after the current batch; a second one stops at once.

    Stopping between batches is what keeps every measurement: a batch is committed to the record
    store as a whole, after it was measured.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def on_interrupt(signum, frame) -> None:
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)


def _ignore_interrupts() -> None:
    """Builder and runner workers share the terminal's process group: Ctrl-C is for the main process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@derived_object
class _ReportProgress(PyMeasureCallback):
    """Counts the trials of the running task and reports the best latency after every batch."""

    def __init__(self, on_batch: Callable[[int, float | None], None], stop: threading.Event):
        self.on_batch = on_batch
        self.stop = stop

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        fastest = None
        for built, ran in zip(builder_results, runner_results):
            if built.error_msg is None and ran.error_msg is None and ran.run_secs:
                secs = sum(float(s) for s in ran.run_secs) / len(ran.run_secs)
                fastest = secs if fastest is None else min(fastest, secs)
        self.on_batch(len(measure_candidates), fastest)
        if self.stop.is_set():  # the default callbacks before this one have committed the batch
            raise TuningInterrupted("stop requested")


def _search_strategy(name: str):
    if name == "evolutionary":
        return ms.search_strategy.EvolutionarySearch()
    raise ValueError(f"unknown search strategy {name!r}")  # the recipe schema admits no other


def tune(
    tasks: list[TuningTask],
    target: tvm.target.Target,
    store: RecordStore,
    plan: TuningPlan,
    progress: ProgressFn | None = None,
) -> TuningResult:
    """Measure what is still missing for each task; the store keeps every committed record."""
    started = time.monotonic()
    result = TuningResult()
    counts = store.measured_counts()
    pending = [(t, counts[_key(t)]) for t in tasks]
    if any(plan.trials_per_task > done for _, done in pending):
        builder = create_builder(max_workers=plan.cores, initializer=_ignore_interrupts)
        runner = ms.runner.LocalRunner(initializer=_ignore_interrupts)
        cost_model = ms.cost_model.XGBModel(
            extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True, num_tuning_cores=plan.cores
        )
    with _stop_requests() as stop:
        for index, (task, done) in enumerate(pending, start=1):
            outcome = TaskOutcome(task.name, task.weight, task.flops, done, 0, None)
            result.tasks.append(outcome)
            missing = plan.trials_per_task - done
            over_budget = plan.time_budget_s is not None and time.monotonic() - started >= plan.time_budget_s
            if missing > 0 and over_budget:
                outcome.skipped_for_budget = True
            elif missing > 0:
                try:
                    _tune_one(task, index, len(tasks), missing, target, store, plan, builder, runner, cost_model,
                              outcome, progress, started, stop)
                except Exception:  # the stop request comes back through TVM's C++ loop, maybe re-wrapped
                    if not stop.is_set():
                        raise
                if stop.is_set():
                    measured = sum(t.trials_measured for t in result.tasks)
                    raise TuningInterrupted(
                        f"interrupted: the {measured} measurements of this run are kept in {store.directory}; "
                        "run the same command again to resume"
                    )
            _finish_task(task, index, len(tasks), done, outcome, store, plan, progress, started)
    result.wall_s = time.monotonic() - started
    return result


def _finish_task(task, index, total, done, outcome, store, plan, progress, started) -> None:
    best = store.best_seconds(task)
    outcome.best_us = best * 1e6 if best is not None else None
    if progress and outcome.trials_measured == 0:  # otherwise each batch was reported already
        progress(TaskProgress(index, total, task.name, done, plan.trials_per_task, outcome.best_us,
                              time.monotonic() - started))


def _key(task: TuningTask) -> int:
    import tvm_ffi

    return tvm_ffi.structural_hash(task.mod)


def _tune_one(task, index, total, trials, target, store, plan, builder, runner, cost_model, outcome, progress,
              tuning_started, stop):
    task_started = time.monotonic()
    best = store.best_seconds(task)

    def on_batch(measured: int, fastest: float | None) -> None:
        nonlocal best
        outcome.trials_measured += measured
        if fastest is not None and (best is None or fastest < best):
            best = fastest
        store.log_batch({
            "task": task.name,
            "measured": measured,
            "trials": outcome.trials_before + outcome.trials_measured,
            "batch_best_us": fastest * 1e6 if fastest is not None else None,
            "best_us": best * 1e6 if best is not None else None,
            "elapsed_s": round(time.monotonic() - tuning_started, 3),
        })
        if progress:
            progress(TaskProgress(index, total, task.name, outcome.trials_before + outcome.trials_measured,
                                  plan.trials_per_task, best * 1e6 if best else None,
                                  time.monotonic() - tuning_started))

    context = ms.TuneContext(
        mod=task.mod,
        target=target,
        space_generator="post-order-apply",
        search_strategy=_search_strategy(plan.search),
        task_name=task.name,
        rand_state=plan.seed + index,
        num_threads=plan.cores,
    )
    callbacks = list(MeasureCallback.create("default")) + [_ReportProgress(on_batch, stop)]
    ms.tune_tasks(
        tasks=[context],
        task_weights=[float(task.weight)],
        work_dir=str(store.directory.parent / "logs"),
        max_trials_global=trials,
        max_trials_per_task=trials,
        num_trials_per_iter=min(trials, _MAX_TRIALS_PER_ROUND),
        builder=builder,
        runner=runner,
        database=store.database,
        cost_model=cost_model,
        measure_callbacks=callbacks,
        task_scheduler="round-robin",
    )
    outcome.tuning_s = time.monotonic() - task_started
