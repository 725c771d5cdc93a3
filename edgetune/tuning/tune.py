"""Tune every task of one target with MetaSchedule, resumably.

Each task gets `trials_per_task` measurements in total across builds: what the target's record
store already holds counts, so re-running a finished build measures nothing. One cost model is
shared by all tasks of a target (as in `tune_tasks`). Which task is tuned next, and for how many
trials, is the task scheduler's (`task_scheduler.py`); each of its rounds is one `tune_tasks` call here.

A task whose tuning raises keeps what it measured (its best schedule so far, or none: the untuned
one), is marked `tuning_failed`, and the other tasks go on: one kernel TVM cannot search must not
throw away the model's other kernels. Ctrl-C still stops everything (TuningInterrupted).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import MeasureCallback, PyMeasureCallback
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

from edgetune.errors import EdgetuneError
from edgetune.fleet.endpoints import RemoteDevice
from edgetune.profiles import Hardware
from edgetune.runtime import use_cpu_threads
from edgetune.tuning import search_strategy
from edgetune.tuning.analyzer.space import replay_text, trace_text
from edgetune.tuning.builder import STRAGGLER_ERROR, linking_builder
from edgetune.tuning.cost_model.ranking import RankingCostModel
from edgetune.tuning.cost_model.transfer import TransferCostModel, TransferMode
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.first_batch import DraftFn, FirstMeasured, measure_first_batch
from edgetune.tuning.local_runner import LocalCandidateRunner
from edgetune.tuning.measurements import FAILED, WatchesTimingNoise, measure_candidate
from edgetune.tuning.remote import DeviceLost, RetryingRPCRunner
from edgetune.tuning.search_strategy.deadline import EndsByDeadline, RoundCut
from edgetune.tuning.search_strategy.draft_verify import SearchCounts, analyzer_best
from edgetune.tuning.search_strategy.seeded import SeededSearch
from edgetune.tuning.task_scheduler import MAX_TRIALS_PER_ROUND, TaskOutcome, TaskScheduler, curve_point
from edgetune.tuning.tasks import TuningTask
from edgetune.tuning.transfer.siblings import SiblingRecords, TransferStats, tuning_context
from edgetune.tuning.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class CandidateMeasurer(Protocol):
    """What the tuning loop asks of a device (edgetune.devices.Device fits): MetaSchedule's builder and
    runner for it, on `cores` workers, each with a `close()` that ends its workers when tuning ends; `stop`
    is the loop's stop request."""

    def tuning_builder_runner(self, cores: int, stop: threading.Event) -> tuple[ms.builder.Builder,
                                                                                ms.runner.Runner]: ...


@dataclass(frozen=True)
class TuningPlan:
    trials_per_task: int
    time_budget_s: float | None
    search: str
    seed: int
    cores: int
    hardware: Hardware | None = None  # the device profile's numbers, for draft-verify's analyzer
    device: str = "cpu"  # the profile's runtime device: "cpu", "cuda", "opencl"
    isa: str = "x86_64"
    remote: RemoteDevice | None = None  # measured on this device over RPC; None: on this machine
    siblings: SiblingRecords | None = None  # what sibling devices measured of these tasks
    transfer: TransferMode = "momentum"
    keep_for_later: Callable[[], float] | None = None
    """Under a budget: asked once, after the first pass (every task has a schedule), for the seconds of
    the budget to leave to work after tuning (comparing schedules inside the model)."""
    runs_on: CandidateMeasurer | None = None
    """Where candidates are built and timed: the build's device (edgetune.devices). Left out, `remote`
    (a device over RPC) or else this machine."""
    started: float | None = None
    """time.monotonic() when the tuning began, if before `tune` (the siblings' records were read from then):
    the budget and the tuning curve count from it. Left out: when `tune` starts."""


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
    budget_s: float | None = None  # the tuning's time budget: no estimate of what is left goes past it

    @property
    def trials_text(self) -> str:
        """"16/64 trials", or "16 trials" where only the time budget bounds them (no trial count was given)."""
        if self.trials_planned >= UNBOUNDED_TRIALS:
            return f"{self.trials_done} trials"
        return f"{self.trials_done}/{self.trials_planned} trials"

    @property
    def bounded_by_budget(self) -> bool:
        """Only the time budget bounds the trials (no trial count was given): the budget ends the tuning."""
        return self.budget_s is not None and self.trials_planned >= UNBOUNDED_TRIALS

    @property
    def tasks_done(self) -> float:
        """Tasks tuned so far, this one's done share included (what a progress bar fills)."""
        return self.index - 1 + (self.trials_done / self.trials_planned if self.trials_planned else 1.0)

    def seconds_left(self) -> float | None:
        """Seconds of tuning left: where only the budget bounds the trials, the rest of the budget (the tuning
        spends it); else the tasks left at the pace so far, never past the budget. None before any pace.

        The tasks' pace alone told a 60-minute build's first pass "~13 s left" after 58 s, a default build's
        "~205 s left" after 14 s of its 10 minutes: without a trial count no task is ever done before the end."""
        budget = self.budget_s
        if budget is not None and self.bounded_by_budget:
            return max(0.0, budget - self.elapsed_s)
        done = self.tasks_done
        left = self.elapsed_s / done * (self.total - done) if done > 0 else None
        if budget is not None:
            left = max(0.0, min(left if left is not None else budget, budget - self.elapsed_s))
        return left


UNBOUNDED_TRIALS = 1_000_000
"""The trials per task of a recipe that gives a time budget and no trial count: the budget stops the tuning."""


@dataclass
class TuningResult:
    tasks: list[TaskOutcome] = field(default_factory=list)
    wall_s: float = 0.0
    kept_s: float = 0.0  # of the budget, left to work after tuning (plan.keep_for_later)
    curve: list[tuple[float, float]] = field(default_factory=list)  # TaskScheduler.curve
    transfer: TransferStats | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds by phase, in order: "first_batch" (every task's first schedules), "first_fits" (the cost model
    learning them), "rounds" (the scheduler's rounds, less "reserve": one compile and run of the model sizing
    the budget's reserve). A build that stalls says where."""

    @property
    def trials_measured(self) -> int:
        return sum(t.trials_measured for t in self.tasks)

    @property
    def failed(self) -> list[TaskOutcome]:
        return [t for t in self.tasks if t.tuning_failed is not None]


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


@derived_object
class _ReportProgress(PyMeasureCallback):
    """Counts the trials of the running task and reports the best latency after every batch."""

    def __init__(self, on_batch: Callable[[int, float | None, int], None], stop: threading.Event):
        self.on_batch = on_batch
        self.stop = stop

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        fastest = None
        for built, ran in zip(builder_results, runner_results):
            if built.error_msg is None and ran.error_msg is None and ran.run_secs:
                secs = sum(float(s) for s in ran.run_secs) / len(ran.run_secs)
                fastest = secs if fastest is None else min(fastest, secs)
        builds_cut = sum(1 for built in builder_results if (built.error_msg or "").startswith(STRAGGLER_ERROR))
        self.on_batch(len(measure_candidates), fastest, builds_cut)
        if self.stop.is_set():  # the default callbacks before this one have committed the batch
            raise TuningInterrupted("stop requested")


def _search_strategy(plan: TuningPlan, counts: SearchCounts, cost_model, stats: TransferStats | None,
                     round_trials: int):
    """The recipe's search; with sibling records, their best schedules are measured first."""
    prior = cost_model if isinstance(cost_model, TransferCostModel) else None
    strategy = search_strategy.create(plan.search, round_trials=round_trials, hardware=plan.hardware,
                                      device=plan.device, isa=plan.isa, counts=counts, prior=prior)
    if stats is None:
        return strategy
    return SeededSearch(strategy, plan.siblings.seeds, stats)


def _transfers(plan: TuningPlan) -> bool:
    return plan.transfer != "off" and plan.siblings is not None and not plan.siblings.empty


def _cost_model(plan: TuningPlan, store: RecordStore, stats: TransferStats | None):
    """TVM's XGBModel for the stock search; draft-verify's ranking model, kept with the records.

    With siblings, either search uses the transferred ranking model: its prior and its own
    measurements both train rankers, and a ranker's scores are all a search needs.
    """
    if plan.search == "draft-verify" or stats is not None:
        local = RankingCostModel(num_threads=plan.cores, path=store.directory / "cost_model.npz")
        if stats is None:
            return local
        return TransferCostModel(local, plan.siblings, plan.transfer, stats)
    return ms.cost_model.XGBModel(
        extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True, num_tuning_cores=plan.cores
    )


_COLD_RUNS = 10
"""Cold runs per candidate on a CPU; their mean is the candidate's time."""


def timing(device: str) -> ms.runner.EvaluatorConfig:
    """How a candidate is timed: on a CPU, each run starts with its weights and output out of the cache.

    In a model, a kernel's input was just written by the kernel before it, but its weights were last
    read one inference ago, and the other layers have evicted them since: ResNet-18's weights (46 MB)
    exceed this host's L3 (32 MB). Timed warm, as MetaSchedule does by default, the tuned kernels of a
    ResNet-18 build added up to 13.9 ms while the model took 16.7 ms; timed cold, to 15.8 ms. Tuning
    against the cold time ranks candidates by how they run in the model. GPUs keep MetaSchedule's timing.
    """
    if device == "cpu":
        return ms.runner.EvaluatorConfig(number=1, repeat=_COLD_RUNS, min_repeat_ms=0, enable_cpu_cache_flush=True)
    return ms.runner.EvaluatorConfig()


def _measurers(plan: TuningPlan, stop: threading.Event):
    """The plan's device builds and times the candidates; a plan without one names a `remote` or means here."""
    if plan.runs_on is not None:
        return plan.runs_on.tuning_builder_runner(plan.cores, stop)
    if plan.remote is not None:
        return remote_builder_runner(plan.remote, plan.cores, plan.device, stop)
    return local_builder_runner(plan.cores, plan.device)


def local_builder_runner(cores: int, device: str) -> tuple[ms.builder.Builder, ms.runner.Runner]:
    """Candidates built and run on this machine, on the target's cores, by one pool of workers, which start
    now: the first batch's seeds are replayed or its drafts made while they do."""
    if device == "cpu":
        use_cpu_threads(cores)  # inherited by the runner's workers
    workers = WorkerPool(cores, timeout=None, stderr=subprocess.DEVNULL)
    workers.start_workers()
    runner = LocalCandidateRunner(timing(device), pool=workers, cpu_threads=cores if device == "cpu" else None)
    return linking_builder(cores, None, pool=workers), runner


def remote_builder_runner(remote: RemoteDevice, cores: int, device: str,
                          stop: threading.Event) -> tuple[ms.builder.Builder, ms.runner.Runner]:
    """Candidates linked here for the device and measured on it over RPC; a lost key sets `stop`. The builder's
    workers start now, as on this machine."""
    builder = linking_builder(cores, remote.compiler)
    builder.pool.start_workers()
    return builder, RetryingRPCRunner(remote, stop, timing(device))


def tune(
    tasks: list[TuningTask],
    target: tvm.target.Target,
    store: RecordStore,
    plan: TuningPlan,
    progress: ProgressFn | None = None,
    logs_dir: Path | None = None,
) -> TuningResult:
    """Measure what is still missing for each task; the store keeps every committed record.

    `logs_dir`: where MetaSchedule writes its logs (default: beside the store).
    """
    started = plan.started if plan.started is not None else time.monotonic()
    result = TuningResult()
    if _transfers(plan):
        result.transfer = TransferStats(plan.siblings.sources, plan.transfer, plan.siblings.records_used)
    counts = store.measured_counts()
    pending = [(t, counts[task_key(t)]) for t in tasks]
    result.tasks = [TaskOutcome(t.name, t.weight, t.flops, done, 0, best_us(store, t),
                                sibling_seeds=_seeds_waiting(plan, t, done)) for t, done in pending]
    curve: list[tuple[float, float]] = []
    resumed = curve_point(result.tasks, started)
    if resumed is not None:  # every task had a best from earlier builds: the curve starts there, at 0 s
        curve.append((0.0, resumed[1]))
    runner = None  # no workers start when every task has its trials: a stop request then names no device
    with _stop_requests() as stop, ExitStack() as workers:
        if any(plan.trials_per_task > done for _, done in pending):
            builder, runner = _measurers(plan, stop)
            workers.callback(builder.close)  # the workers end with the tuning, before the compile needs memory
            workers.callback(runner.close)
            batch_started = time.monotonic()
            firsts = _first_batch(tasks, result, target, store, plan, builder, runner, progress, started, stop)
            curve += [point for point in [curve_point(result.tasks, started)] if point is not None]
            fits_started = time.monotonic()
            result.phases_s["first_batch"] = fits_started - batch_started
            cost_model = _cost_model(plan, store, result.transfer)
            for first in firsts:
                cost_model.update(first.context, [first.candidate], [first.result])
            result.phases_s["first_fits"] = time.monotonic() - fits_started

        def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> bool:
            task, outcome = tasks[position], result.tasks[position]
            if isinstance(cost_model, TransferCostModel) and not plan.siblings.prior_loaded and (
                    outcome.sibling_seeds or outcome.last_round_s > 0):
                _load_prior(plan, tasks, target, cost_model, result.transfer, builder.pool)
            bounds = RoundBounds(trials, enough, deadline)
            try:
                _tune_one(task, position + 1, len(tasks), bounds, target, store, plan, builder, runner, cost_model,
                          outcome, progress, started, stop, logs_dir or store.directory / "logs", result.transfer)
            except Exception as exc:  # the stop request comes back through TVM's C++ loop, maybe re-wrapped
                if not stop.is_set():
                    _task_failed(task, outcome, exc)
            return bounds.cut.cut

        def after_round() -> None:
            if stop.is_set():
                raise _stopped(runner, result, store)

        scheduler = TaskScheduler(result.tasks, plan.trials_per_task, plan.time_budget_s, started, measure_round,
                                  lambda position: best_us(store, tasks[position]), after_round,
                                  round_trials=search_strategy.round_trials_under_budget(plan.search,
                                                                                         MAX_TRIALS_PER_ROUND),
                                  curve=curve)
        rounds_started = time.monotonic()
        result.kept_s = scheduler.run(_timed_reserve(plan.keep_for_later, result.phases_s))
        result.phases_s["rounds"] = time.monotonic() - rounds_started - result.phases_s.get("reserve", 0.0)
        if stop.is_set():  # a Ctrl-C after the last round still stops the command, not only the tuning
            raise _stopped(runner, result, store)
        result.curve = scheduler.curve
        for index, ((task, done), outcome) in enumerate(zip(pending, result.tasks), start=1):
            _finish_task(task, index, len(tasks), done, outcome, plan, progress, started)
        count_committed(tasks, result.tasks, counts, store)
    result.wall_s = time.monotonic() - started
    return result


def _timed_reserve(keep_for_later: Callable[[], float] | None, phases_s: dict[str, float]
                   ) -> Callable[[], float] | None:
    """The budget's reserve call, its seconds noted in `phases_s` ("reserve")."""
    if keep_for_later is None:
        return None

    def timed() -> float:
        asked = time.monotonic()
        try:
            return keep_for_later()
        finally:
            phases_s["reserve"] = phases_s.get("reserve", 0.0) + time.monotonic() - asked

    return timed


def _first_batch(tasks: list[TuningTask], result: TuningResult, target: tvm.target.Target, store: RecordStore,
                 plan: TuningPlan, builder, runner, progress: ProgressFn | None, started: float,
                 stop: threading.Event) -> list[FirstMeasured]:
    """Every task's first schedules measured in one batch before any search (`first_batch`): with siblings,
    each task's best sibling schedule; with draft-verify, the analyzer's best drafts of each task without one.
    Each is logged and made durable once measured; a batch that fails leaves the rest to each task's first
    round, a stop request stops the tuning after it."""
    if result.transfer is None and plan.search != "draft-verify":
        return []
    firsts: list[FirstMeasured] = []

    def on_measured(first: FirstMeasured) -> None:
        firsts.append(first)
        outcome = result.tasks[first.position]
        _batch_measured(store, plan, progress, started, first.position + 1, len(tasks), tasks[first.position].name,
                        outcome, 1, first.seconds if first.seconds < FAILED else None, outcome.best_us)

    seeds = plan.siblings.seeds if result.transfer is not None else {}
    try:
        measure_first_batch(tasks, result.tasks, target, store, builder, runner, seeds, result.transfer,
                            plan.cores, on_measured, _first_drafts(tasks, result, target, plan, builder.pool))
    except Exception as exc:  # noqa: BLE001 (any failure: the rest go back to the rounds; a lost device sets `stop`)
        if not stop.is_set():
            logger.warning("the first schedules of every task could not all be measured in one batch (%s: %s); "
                           "each task measures the rest in its first round", type(exc).__name__, exc)
    if stop.is_set():
        raise _stopped(runner, result, store)
    return firsts


FIRST_DRAFTS = 2
"""The analyzer's drafts of a task without a sibling's seed, measured in the first batch."""
FIRST_DRAFTS_HEAVY, HEAVY_SHARE = 4, 0.5
"""Drafts of a task whose FLOPs (per call x calls) are at least HEAVY_SHARE of the heaviest task's: where the
model's time is, the better of two drafts varies most (a ResNet-18's 512-channel convolution: 560-983 us over
five seeds). Side by side (`variants.py --budget-min 1.5 --seeds 1 2 3 4 5`, znver5), four drafts for its four
heaviest tasks made the first batch's model 6.99-8.13 ms against 8.13-9.92 ms (median 7.74 against 9.15) for
0.6-1.9 s more of first batch, and ONNX Runtime was beaten in 5 of 5 builds against 4 of 5. On a ResNet-50 export
(7 of 28 tasks heavy, znver5) the final artifacts were 1.05x slower at 3 minutes (3 seeds) and as fast at 10 (2 seeds:
1.00x)."""


def first_draft_counts(total_flops: list[float]) -> list[int]:
    """The first batch's drafts of each task, given each task's FLOPs per call times its calls."""
    heaviest = max(total_flops, default=0.0)
    return [FIRST_DRAFTS_HEAVY if heaviest > 0 and flops >= HEAVY_SHARE * heaviest else FIRST_DRAFTS
            for flops in total_flops]


def _first_drafts(tasks: list[TuningTask], result: TuningResult, target: tvm.target.Target, plan: TuningPlan,
                  pool: WorkerPool | None) -> DraftFn | None:
    """With draft-verify, a task without a sibling's seed gets the analyzer's best drafts in the first batch
    (`first_draft_counts`; the rest of its first round follows); the stock search has no analyzer to draft with.

    The tasks are drafted on the tuning's `pool`, one job per task, while its workers are idle: in this
    process a MobileNet-V2's 34 tasks took 21 s, half of its first batch, on one of two cores. Without a pool
    (benchmarks/first_drafts.py's baseline) they are drafted here, through the same trace texts."""
    if plan.search != "draft-verify":
        return None
    sendable = replace(plan, remote=None, siblings=None, keep_for_later=None, runs_on=None)  # what pickles
    wanted_drafts = first_draft_counts([task.total_flops for task in tasks])

    def drafts(positions: list[int]) -> list[tuple[int, ms.TuneContext, list[MeasureCandidate]]]:
        counts = {p: min(wanted_drafts[p], plan.trials_per_task - result.tasks[p].trials_before) for p in positions}
        wanted = [p for p in positions if counts[p] > 0]
        jobs = {p: pool.submit_with_timeout(None, drafted_traces, tasks[p], p + 1, target, sendable, counts[p],
                                            result.tasks[p].search) for p in wanted} if pool is not None else {}
        drafted = []
        for p in wanted:
            try:
                traces, result.tasks[p].search = jobs[p].result() if p in jobs else drafted_traces(
                    tasks[p], p + 1, target, sendable, counts[p], result.tasks[p].search)
            except Exception as exc:  # noqa: BLE001 (the task's first round drafts again, or falls back, as always)
                logger.warning("no first draft of %s for the first batch (%s: %s)", tasks[p].name,
                               type(exc).__name__, exc)
                continue
            context = _tuning_context(tasks[p], p + 1, target, plan, None)
            postprocs = list(context.space_generator.postprocs)
            schedules = [replay_text(tasks[p].mod, text, postprocs, seed=i + 1) for i, text in enumerate(traces)]
            drafted.append((p, context, [measure_candidate(s) for s in schedules if s is not None]))
        return drafted

    return drafts


def drafted_traces(task: TuningTask, index: int, target: tvm.target.Target, plan: TuningPlan, count: int,
                   counts: SearchCounts) -> tuple[list[str], SearchCounts]:
    """The analyzer's `count` best drafts of the (1-based `index`) task, as trace texts (a worker of the
    tuning's pool sends them back), and the search's `counts` with them added."""
    strategy = _search_strategy(plan, counts, None, None, count)
    context = _tuning_context(task, index, target, plan, strategy)
    return [trace_text(candidate.sch.trace) for candidate in analyzer_best(context, strategy, count)], counts


def _batch_measured(store: RecordStore, plan: TuningPlan, progress: ProgressFn | None, started: float, index: int,
                    total: int, task: str, outcome: TaskOutcome, measured: int, fastest_s: float | None,
                    best_us: float | None) -> None:
    """A measured batch of a task (its `outcome` counts it already): its line in the store's tuning log, which
    makes the batch's records durable, and the progress shown."""
    trials = outcome.trials_before + outcome.trials_measured
    store.log_batch({"task": task, "measured": measured, "trials": trials,
                     "batch_best_us": fastest_s * 1e6 if fastest_s is not None else None, "best_us": best_us,
                     "elapsed_s": round(time.monotonic() - started, 3)})
    if progress:
        progress(TaskProgress(index, total, task, trials, plan.trials_per_task, best_us,
                              time.monotonic() - started, plan.time_budget_s))


def _load_prior(plan: TuningPlan, tasks: list[TuningTask], target: tvm.target.Target, cost_model: TransferCostModel,
                stats: TransferStats, pool: WorkerPool) -> None:
    """The siblings' prior (replaying and featurizing a 1-core ResNet-18 sibling's 410 records: 7.4 s on the
    tuning's two idle workers, 12.9 s in this process), loaded before the first round of a task with sibling
    schedules, or before the second round of a task without any (another algorithm was chosen for the sibling:
    its Winograd and direct convolutions differ). Those tasks' first rounds search as from scratch, with this device's own model, and do not wait
    for records the siblings have none of: a ResNet-18's heaviest task is one of them, and its two first drafts
    (945-1124 us, where its first round reached 620-690) held the model at ONNX Runtime's time until its first
    round ended, 12 s after the first batch, 7 of them reading the prior. The rounds after use the prior."""
    plan.siblings.load_prior(tasks, target, plan.cores, pool)
    cost_model.adopt_prior(plan.siblings)
    stats.sibling_records = plan.siblings.records_used


def _stopped(runner, result: TuningResult, store: RecordStore) -> EdgetuneError:
    """Why tuning stops at a stop request: the device lost (RPC), or an interrupt; the records are kept."""
    kept = f"the {result.trials_measured} measurements of this run are kept in {store.directory}"
    if isinstance(runner, RetryingRPCRunner) and runner.lost:
        return DeviceLost(f"{runner.lost}: tuning stopped; {kept}; run the same command again to resume once "
                          "a server is back")
    return TuningInterrupted(f"interrupted: {kept}; run the same command again to resume")


def _seeds_waiting(plan: TuningPlan, task: TuningTask, done: int) -> int:
    """The siblings' schedules `SeededSearch` measures first for the task (none once its store has records)."""
    if done or not _transfers(plan):
        return 0
    return len(plan.siblings.seeds.get(task_key(task), []))


def _task_failed(task: TuningTask, outcome: TaskOutcome, exc: Exception) -> None:
    """The task keeps what it measured and gets no further round; the build goes on."""
    outcome.tuning_failed = f"{type(exc).__name__}: {exc}"
    logger.warning("tuning of task %s failed (%s); it keeps its best schedule so far", task.name,
                   outcome.tuning_failed, exc_info=exc)


def count_committed(tasks: list[TuningTask], outcomes: list[TaskOutcome], before, store: RecordStore) -> None:
    """Each task's measurements of this build, as its records in the store: what a failed round
    measured before it raised is committed, and counted, like any other."""
    after = store.measured_counts()
    for task, outcome in zip(tasks, outcomes):
        key = task_key(task)
        outcome.trials_measured = max(0, after[key] - before[key])
        outcome.best_us = best_us(store, task)


def best_us(store: RecordStore, task: TuningTask) -> float | None:
    """The task's best measured latency in the store, in microseconds (None: no valid record)."""
    best = store.best_seconds(task)
    return best * 1e6 if best is not None else None


def _finish_task(task, index, total, done, outcome, plan, progress, started) -> None:
    """A task this build measured nothing of still shows in the progress, with its stored best."""
    if progress and outcome.trials_measured == 0 and plan.trials_per_task > 0 and not outcome.skipped_for_budget:
        progress(TaskProgress(index, total, task.name, done, plan.trials_per_task, outcome.best_us,
                              time.monotonic() - started, plan.time_budget_s))


def task_key(task: TuningTask) -> int:
    """The task's workload hash, as the store counts its records (RecordStore.measured_counts)."""
    import tvm_ffi

    return tvm_ffi.structural_hash(task.mod)


@dataclass
class RoundBounds:
    """A round of one task: up to `trials` measurements, no further search iteration once `enough` were sent,
    nor one that would end more than half past `deadline` (a `time.monotonic()` instant; then `cut` says so)."""

    trials: int
    enough: int
    deadline: float | None
    cut: RoundCut = field(default_factory=RoundCut)


def _tune_one(task, index, total, bounds: RoundBounds, target, store, plan, builder, runner, cost_model, outcome,
              progress, tuning_started, stop, logs_dir, transfer):
    """A round of one task within its `bounds`."""
    trials = bounds.trials
    best = store.best_seconds(task)

    def on_batch(measured: int, fastest: float | None, builds_cut: int) -> None:
        nonlocal best
        if measured == 0:  # the search found no new candidate (it gives up after a few such rounds)
            return
        outcome.trials_measured += measured
        outcome.builds_cut += builds_cut
        if fastest is not None and (best is None or fastest < best):
            best = fastest
        _batch_measured(store, plan, progress, tuning_started, index, total, task.name, outcome, measured,
                        fastest, best * 1e6 if best is not None else None)

    per_round = min(trials, MAX_TRIALS_PER_ROUND)
    strategy = _search_strategy(plan, outcome.search, cost_model, transfer, per_round)
    if bounds.deadline is not None:
        strategy = EndsByDeadline(strategy, bounds.deadline, bounds.cut)
    context = _tuning_context(task, index, target, plan, strategy)
    callbacks = list(MeasureCallback.create("default")) + [_ReportProgress(on_batch, stop)]
    _watch_noise(runner, outcome, best)
    ms.tune_tasks(
        tasks=[context],
        task_weights=[float(task.weight)],
        work_dir=str(logs_dir),
        max_trials_global=bounds.enough,  # counts candidates sent: the loop ends once it is reached
        max_trials_per_task=trials,
        num_trials_per_iter=per_round,
        builder=builder,
        runner=runner,
        database=store.database,
        cost_model=cost_model,
        measure_callbacks=callbacks,
        task_scheduler="round-robin",
    )


def _tuning_context(task: TuningTask, index: int, target: tvm.target.Target, plan: TuningPlan,
                    strategy) -> ms.TuneContext:
    """The task's (1-based `index`) MetaSchedule context for a round, or for its first drafts: the plan's seed
    and cores."""
    return tuning_context(task, target, plan.cores, strategy, plan.seed + index)


def _watch_noise(runner: ms.runner.Runner, outcome: TaskOutcome, best_s: float | None) -> None:
    """A round of one task starts: the runner's watch over disturbed timings compares them with the task's
    best and counts them into its outcome."""
    if isinstance(runner, WatchesTimingNoise):
        runner.noise.watch(outcome.timings, best_s)
