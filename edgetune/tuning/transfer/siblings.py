"""Transfer from sibling devices: what the siblings measured, loaded for the device being tuned.

A sibling is another device of the fleet (same ISA family) whose record store already holds
measurements of the same workloads. Three things carry over to the device being tuned:

- seeds: the siblings' best schedules for each task are replayed for this device's target
  and measured first: every task's best one in one batch before any search (`tuning.first_batch`),
  the rest in the task's first round (`search_strategy.seeded.SeededSearch`, wrapping either search);
- a prior: a ranker trained on the siblings' records (`SiblingRecords.groups`, one ranking
  group per sibling and task, since the devices' speeds differ) predicts from the first batch;
- adaptation and a guard (`cost_model.transfer.TransferCostModel`, "warm" or "momentum").

This module loads the first two from the siblings' stores; `TransferStats` is what transfer did.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.database import TuningRecord, Workload
from tvm.s_tir.schedule import Trace

from edgetune.frontend.winograd import register_schedule_rules
from edgetune.tuning.analyzer.space import TVM_ERRORS, replay
from edgetune.tuning.cost_model.ranking import Groups, RankingCostModel
from edgetune.tuning.database.store import RankedStore, StoredRecords
from edgetune.tuning.intrinsics import register_tensor_intrinsics
from edgetune.tuning.measurements import mean_seconds, measure_candidate
from edgetune.tuning.tasks import TuningTask
from edgetune.tuning.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

SEEDS_PER_TASK = 4
"""Sibling schedules re-measured first for each task (the best ones, across siblings)."""
PRIOR_RECORDS_PER_TASK = 128
"""Best records per sibling and task the prior is trained on."""


class SiblingSchedule:
    """One of a sibling's measured schedules of a task: its stored record, read by TVM (which replays its trace
    to read it) only when it is first replayed. Of a task's four seeds the first batch replays one or two, the
    rest wait for the task's round: loading a ResNet-18 sibling's 56 seeds, before anything is measured, took
    0.87 s when each was read at once, 0.56 s now."""

    def __init__(self, workload: Workload, record: list) -> None:
        self.workload = workload
        self.record = record
        self._trace: Trace | None = None

    def replay(self, mod: tvm.IRModule, postprocs: list, seed: int) -> Schedule | None:
        """Its schedule of `mod` checked by `postprocs` (`analyzer.space.replay`); None where the record does
        not read or does not replay."""
        if self._trace is None:
            try:
                self._trace = TuningRecord.from_json(self.record, self.workload).trace
            except TVM_ERRORS:
                return None
        return replay(mod, self._trace, postprocs, seed)


@dataclass
class SiblingRecords:
    """What the siblings measured of this device's tasks: the seeds at once, the prior when asked for.

    The seeds are each sibling's few best records, read alone (`RankedStore`): cheap, so the seeds can be
    measured before anything else. The prior's rows read, replay and featurize up to PRIOR_RECORDS_PER_TASK
    records per sibling and task (14 s for a 1-core ResNet-18 sibling's 410 records, in one process):
    `load_prior` reads them after the first batch, before the first round of a task the siblings measured
    (`tune._load_prior`), inside the tuning's clock."""

    sources: list[str]
    groups: Groups = field(default_factory=dict)  # prior's training data, per sibling and task
    seeds: dict[int, list[SiblingSchedule]] = field(default_factory=dict)  # task workload hash -> seeds, best first
    records_used: int = 0
    stores: Mapping[str, RankedStore] = field(default_factory=dict)  # where the prior is read from
    prior_loaded: bool = False

    @property
    def empty(self) -> bool:
        return not self.groups and not any(self.seeds.values())

    def load_prior(self, tasks: list[TuningTask], target: tvm.target.Target, num_threads: int,
                   pool: WorkerPool | None = None) -> None:
        """Feature rows for the prior: each sibling's best records of each task replayed on this target and
        featurized as this device's candidates are; once. With a `pool` (the tuning's idle workers), each task's
        records are read on a worker: 12.9-14 s in this process for a 1-core ResNet-18 sibling's 410 records (two
        fifths TVM reading them, which replays each trace; nearly half replaying them again with postprocessing;
        a tenth their features), 7.4 s on two workers."""
        if self.prior_loaded:
            return
        self.prior_loaded = True
        wanted = [(task, name, records) for task in tasks for name, store in self.stores.items()
                  if (records := store.best_json(task, PRIOR_RECORDS_PER_TASK)) is not None]
        jobs = [pool.submit_with_timeout(None, prior_rows, task, records, target, num_threads)
                if pool is not None else None for task, _, records in wanted]
        for (task, name, records), job in zip(wanted, jobs):
            rows = _job_result(job) if job is not None else None
            if rows is None:  # no pool, or its worker failed: read here
                rows = prior_rows(task, records, target, num_threads)
            if rows[1]:
                self.groups[f"{name}/{tvm_ffi.structural_hash(task.mod)}"] = rows
                self.records_used += len(rows[1])


def prior_rows(task: TuningTask, records: StoredRecords, target: tvm.target.Target,
               num_threads: int) -> tuple[list, list[float]]:
    """A task's feature rows and seconds from a sibling's records of it (`RankedStore.best_json`): each record
    replayed on `target` (those TVM cannot read or replay are left out) and featurized as this device's
    candidates are. Runs on a worker of the tuning's pool, or here."""
    workload, lines = records
    context = tuning_context(task, target, num_threads)
    postprocs = list(context.space_generator.postprocs)
    schedules, costs = [], []
    for i, line in enumerate(lines):
        schedule = SiblingSchedule(workload, line).replay(task.mod, postprocs, seed=i + 1)
        if schedule is not None:
            schedules.append(schedule)
            costs.append(mean_seconds(line[1]))
    if not schedules:
        return [], []
    featurizer = RankingCostModel(num_threads=num_threads)
    return list(featurizer.features(context, [measure_candidate(s) for s in schedules])), costs


def _job_result(job: Future) -> tuple[list, list[float]] | None:
    """A worker's `prior_rows`; None where the worker failed (the caller reads the records itself)."""
    try:
        return job.result()
    except Exception as exc:  # noqa: BLE001 (a worker lost or killed: the records are read in this process)
        logger.warning("a worker could not read a sibling's records (%s: %s); reading them here",
                       type(exc).__name__, exc)
        return None


def load_sibling_seeds(siblings: Mapping[str, Path], tasks: list[TuningTask]) -> SiblingRecords:
    """Each task's seeds: the siblings' (name -> store directory) SEEDS_PER_TASK best schedules, ranked across
    siblings by their time over the best of their own sibling (the devices' speeds differ). The prior is left
    to `load_prior`."""
    stores = {name: RankedStore(directory) for name, directory in siblings.items()}
    result = SiblingRecords(sources=list(siblings), stores=stores)
    for task in tasks:
        ranked: list[tuple[float, SiblingSchedule]] = []
        for store in stores.values():
            found = store.best_json(task, SEEDS_PER_TASK)
            if found is not None:
                workload, records = found
                best = max(mean_seconds(records[0][1]), 1e-12)  # a 0 s record must not divide by zero
                ranked += [(mean_seconds(r[1]) / best, SiblingSchedule(workload, r)) for r in records]
        ranked.sort(key=lambda pair: pair[0])
        result.seeds[tvm_ffi.structural_hash(task.mod)] = [seed for _, seed in ranked[:SEEDS_PER_TASK]]
    return result


def load_sibling_records(siblings: Mapping[str, Path], tasks: list[TuningTask], target: tvm.target.Target,
                         num_threads: int) -> SiblingRecords:
    """The seeds and the prior's rows at once (see `SiblingRecords`)."""
    result = load_sibling_seeds(siblings, tasks)
    result.load_prior(tasks, target, num_threads)
    return result


def tuning_context(task: TuningTask, target: tvm.target.Target, num_threads: int,
                   search_strategy: ms.search_strategy.SearchStrategy | str | None = "evolutionary",
                   rand_state: int = -1) -> ms.TuneContext:
    """A tuning context of the task for `target` on TVM's default design spaces (its postprocessors check a
    replayed schedule): the one place edgetune makes them. In a worker of the pool too: the intrinsics the
    target's rules look up are registered first (without, the context imports every backend's: 53 s on this VM),
    and edgetune's own rules (winograd.py's data transform)."""
    register_tensor_intrinsics(target)
    register_schedule_rules()
    return ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                          search_strategy=search_strategy, task_name=task.name, rand_state=rand_state,
                          num_threads=num_threads)


@dataclass
class TransferStats:
    """What transfer did for one target, for the summary and the report."""

    sources: list[str]
    mode: str
    sibling_records: int  # records of the siblings the prior was trained on
    seed_best: dict[str, float] = field(default_factory=dict)  # task -> best seconds among its seeds
    seeds_taken: dict[str, int] = field(default_factory=dict)  # task -> its seeds measured so far in this build
    distrusted: set[str] = field(default_factory=set)  # tasks whose prior the guard set aside

    @property
    def seeds_measured(self) -> int:
        """Sibling schedules re-measured on this device in this build."""
        return sum(self.seeds_taken.values())
