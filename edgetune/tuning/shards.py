"""Task-level tuning split across workers: each shard of a target's tasks is searched on a worker, its
candidates measured through the target's device (an RPC tracker key: the tracker hands each batch a
free board), its records committed to a shard store that only its job writes.

A shard store lives inside the target's store (`shards/<i>-of-<k>/`), so it is on storage every worker
reaches when the records directory is. It starts as a copy of the target's records of its tasks (so a
resumed build counts them and the search starts from the best so far), is written only by its job, and
is merged into the target's store (one owner: the target's build) when the job ends; a shard left by a
build that died is merged at the start of the next. A worker lost mid-shard is replaced by the pool and
its job resumes from what the shard store committed: nothing committed is lost, nothing is measured twice.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import tvm_ffi

from edgetune.ownership import create_owned, is_owned
from edgetune.tuning.database.exchange import merge_store
from edgetune.tuning.database.store import RecordStore, commit_record
from edgetune.tuning.task_scheduler import TaskOutcome
from edgetune.tuning.tasks import TuningTask
from edgetune.tuning.transfer.siblings import TransferStats, load_sibling_seeds
from edgetune.tuning.tune import TaskProgress, TuningPlan, TuningResult, best_us, count_committed, task_key, tune

SHARDS_DIR = "shards"
_COST_MODEL = "cost_model.npz"


@dataclass(frozen=True)
class ShardJob:
    """One worker's share of a target's tuning; everything in it pickles (Ray, process pools)."""

    number: int  # 1-based
    of: int
    positions: list[int]  # of its tasks in the target's task list
    tasks: list[TuningTask]
    target: Any  # tvm.target.Target
    store_dir: Path
    plan: TuningPlan  # its budget is what was left when the shards were sent; no closures, no sibling records
    sibling_dirs: dict[str, Path]  # each job reads its own tasks' sibling records
    logs_dir: Path

    @property
    def label(self) -> str:
        return f"shard {self.number}/{self.of}"


@dataclass
class ShardOutcome:
    tasks: list[TaskOutcome]
    curve: list[tuple[float, float]]
    started_at: float  # time.time() when the job began: shards' curves are laid on one clock
    transfer: TransferStats | None = None


class ShardPool(Protocol):
    """Workers that run shard jobs (edgetune.workers: Ray tasks or local processes)."""

    size: int

    def run_shards(self, jobs: list[ShardJob]) -> list[ShardOutcome | str]:
        """Each job's outcome, in order, or why it has none (its worker was lost too often, or it raised)."""


def run_shard(job: ShardJob) -> ShardOutcome:
    """Tune one shard into its own store; runs on a worker. Progress goes to the worker's output."""
    started_at = time.time()
    store = RecordStore(job.store_dir)
    plan = job.plan
    if job.sibling_dirs:
        siblings = load_sibling_seeds(job.sibling_dirs, job.tasks)
        plan = replace(plan, siblings=siblings)

    def show(progress: TaskProgress) -> None:
        if progress.trials_done == progress.trials_planned:
            print(f"[{job.label}] task {progress.task}: {progress.trials_done} trials", flush=True)

    result = tune(job.tasks, job.target, store, plan, show, logs_dir=job.logs_dir)
    return ShardOutcome(result.tasks, result.curve, started_at, result.transfer)


def partition(tasks: list[TuningTask], workers: int) -> list[list[int]]:
    """Positions of the tasks in at most `workers` groups of about equal work (FLOPs times calls), each
    heaviest task to the lightest group so far; deterministic, and no group is empty."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(workers, len(tasks))))]
    loads = [0.0] * len(groups)
    order = sorted(range(len(tasks)), key=lambda p: (-tasks[p].total_flops, p))
    for position in order:
        lightest = min(range(len(groups)), key=lambda g: (loads[g], g))
        groups[lightest].append(position)
        loads[lightest] += max(tasks[position].total_flops, 1.0)
    return [sorted(group) for group in groups if group]


def merge_leftover_shards(store: RecordStore, say: Callable[[str], None]) -> int:
    """Merge the shard stores a build that died left behind into `store`, then remove them; records added."""
    root = store.directory / SHARDS_DIR
    added = 0
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if directory.is_dir() and is_owned(directory):
            added += _merge_shard(directory, store, say)
    return added


def _merge_shard(directory: Path, store: RecordStore, say: Callable[[str], None]) -> int:
    """One shard into `store`, its damaged lines (a worker killed mid-write) reported and skipped, then removed."""
    shard = RecordStore(directory)
    for warning in shard.damage_warnings()[:-1]:  # the repair advice does not apply: the shard is removed now
        say(f"warning: {warning}")
    added = merge_store(shard, store)
    shutil.rmtree(directory)
    return added


def tune_in_shards(tasks: list[TuningTask], target: Any, store: RecordStore, plan: TuningPlan, pool: ShardPool,
                   sibling_dirs: dict[str, Path], logs_dir: Path, say: Callable[[str], None]) -> TuningResult:
    """Tune the tasks on the pool's workers, one shard of tasks each, and merge what they measured into
    `store`; the result reads as `tune`'s (outcomes in task order, the model's curve over all shards)."""
    started = time.monotonic()
    if added := merge_leftover_shards(store, say):
        say(f"merged {added} records that the shards of an interrupted build had committed")
    counts = store.measured_counts()
    wanting = [p for p, t in enumerate(tasks) if counts[task_key(t)] < plan.trials_per_task]
    result = TuningResult()
    budget_s = plan.time_budget_s
    if budget_s is not None and plan.keep_for_later is not None and wanting:
        result.kept_s = plan.keep_for_later()
        budget_s -= result.kept_s
    groups = [[wanting[i] for i in group] for group in partition([tasks[p] for p in wanting], pool.size)]
    if budget_s is not None:
        budget_s -= time.monotonic() - started
    jobs = [_job(number, len(groups), group, tasks, target, store, replace(plan, time_budget_s=budget_s,
                 keep_for_later=None, siblings=None), sibling_dirs, logs_dir)
            for number, group in enumerate(groups, start=1)]
    for job in jobs:
        plural = "s" if len(job.tasks) != 1 else ""
        say(f"{job.label}: {len(job.tasks)} task{plural} ({', '.join(t.name for t in job.tasks)}) on a worker")
    outcomes = pool.run_shards(jobs) if jobs else []
    result.tasks = [TaskOutcome(t.name, t.weight, t.flops, counts[task_key(t)], 0, best_us(store, t)) for t in tasks]
    shard_curves = []
    for job, outcome in zip(jobs, outcomes):
        _merge_shard(job.store_dir, store, say)
        if isinstance(outcome, str):
            say(f"warning: {job.label} failed ({outcome}); its tasks keep what it committed")
            for position in job.positions:
                result.tasks[position].tuning_failed = f"its worker failed: {outcome}"
            continue
        for position, task_outcome in zip(job.positions, outcome.tasks):
            result.tasks[position] = task_outcome
        shard_curves.append((job.positions, outcome))
        result.transfer = _combined_transfer(result.transfer, outcome.transfer)
    count_committed(tasks, result.tasks, counts, store)
    result.curve = _model_curve(result.tasks, shard_curves, time.time() - (time.monotonic() - started))
    result.wall_s = time.monotonic() - started
    return result


def _job(number: int, of: int, positions: list[int], tasks: list[TuningTask], target: Any, store: RecordStore,
         plan: TuningPlan, sibling_dirs: dict[str, Path], logs_dir: Path) -> ShardJob:
    """The shard's job, its store created and filled with the target's records of its tasks."""
    directory = store.directory / SHARDS_DIR / f"{number}-of-{of}"
    create_owned(directory)
    shard = RecordStore(directory)
    keys = {task_key(tasks[p]) for p in positions}
    for record in store.database.get_all_tuning_records():
        if tvm_ffi.structural_hash(record.workload.mod) in keys:
            commit_record(shard.database, record)
    if (store.directory / _COST_MODEL).is_file():
        shutil.copyfile(store.directory / _COST_MODEL, directory / _COST_MODEL)
    shard.sync()
    return ShardJob(number, of, positions, [tasks[p] for p in positions], target, directory, plan, sibling_dirs,
                    logs_dir / f"shard-{number}")


def _model_curve(outcomes: list[TaskOutcome], shards: list[tuple[list[int], ShardOutcome]],
                 started_at: float) -> list[tuple[float, float]]:
    """The model's kernel time against tuning time: at each shard's point, the sum of every shard's latest
    point, plus the tasks no shard tuned (their best, fixed); a point once every shard has one."""
    in_shards = {p for positions, _ in shards for p in positions}
    fixed_ms = sum(o.weight * o.best_us for p, o in enumerate(outcomes)
                   if p not in in_shards and o.best_us is not None) / 1e3
    timed = sorted((outcome.started_at - started_at + seconds, index, ms)
                   for index, (_, outcome) in enumerate(shards) for seconds, ms in outcome.curve)
    latest: dict[int, float] = {}
    curve = []
    for seconds, index, ms in timed:
        latest[index] = ms
        if len(latest) == len(shards):
            curve.append((max(seconds, 0.0), fixed_ms + sum(latest.values())))
    return curve


def _combined_transfer(total: TransferStats | None, shard: TransferStats | None) -> TransferStats | None:
    if shard is None:
        return total
    if total is None:
        return replace(shard, seed_best=dict(shard.seed_best), seeds_taken=dict(shard.seeds_taken),
                       distrusted=set(shard.distrusted))
    total.sibling_records += shard.sibling_records
    total.seeds_taken.update(shard.seeds_taken)  # each task is tuned in one shard
    total.seed_best.update(shard.seed_best)
    total.distrusted |= shard.distrusted
    return total

