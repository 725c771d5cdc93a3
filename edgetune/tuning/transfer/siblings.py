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

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Trace

from edgetune.tuning.analyzer.space import replay
from edgetune.tuning.cost_model.ranking import Groups, RankingCostModel
from edgetune.tuning.database.store import RankedStore
from edgetune.tuning.intrinsics import register_tensor_intrinsics
from edgetune.tuning.measurements import mean_seconds, measure_candidate
from edgetune.tuning.tasks import TuningTask

SEEDS_PER_TASK = 4
"""Sibling schedules re-measured first for each task (the best ones, across siblings)."""
PRIOR_RECORDS_PER_TASK = 128
"""Best records per sibling and task the prior is trained on."""


@dataclass
class SiblingRecords:
    """What the siblings measured of this device's tasks: the seeds at once, the prior when asked for.

    The seeds are each sibling's few best records, read alone (`RankedStore`): cheap, so the seeds can be
    measured before anything else. The prior's rows read, replay and featurize up to PRIOR_RECORDS_PER_TASK
    records per sibling and task (9 s for a ResNet-18's 16 tasks): `load_prior` reads them once every task
    has a schedule, inside the tuning's clock."""

    sources: list[str]
    groups: Groups = field(default_factory=dict)  # prior's training data, per sibling and task
    seeds: dict[int, list[Trace]] = field(default_factory=dict)  # task workload hash -> traces, best first
    records_used: int = 0
    stores: Mapping[str, RankedStore] = field(default_factory=dict)  # where the prior is read from
    prior_loaded: bool = False

    @property
    def empty(self) -> bool:
        return not self.groups and not any(self.seeds.values())

    def load_prior(self, tasks: list[TuningTask], target: tvm.target.Target, num_threads: int) -> None:
        """Feature rows for the prior: each sibling's best records of each task replayed on this target and
        featurized as this device's candidates are; once."""
        if self.prior_loaded:
            return
        self.prior_loaded = True
        featurizer = RankingCostModel(num_threads=num_threads)
        for task in tasks:
            postprocs: list | None = None
            for name, store in self.stores.items():
                records = store.best(task, PRIOR_RECORDS_PER_TASK)
                if not records:
                    continue
                if postprocs is None:
                    context = tuning_context(task, target, num_threads)
                    postprocs = list(context.space_generator.postprocs)
                schedules, costs = [], []
                for i, record in enumerate(records):
                    schedule = replay(task.mod, record.trace, postprocs, seed=i + 1)
                    if schedule is not None:
                        schedules.append(schedule)
                        costs.append(mean_seconds(record.run_secs))
                if schedules:
                    rows = featurizer.features(context, [measure_candidate(s) for s in schedules])
                    self.groups[f"{name}/{tvm_ffi.structural_hash(task.mod)}"] = (list(rows), costs)
                    self.records_used += len(schedules)


def load_sibling_seeds(siblings: Mapping[str, Path], tasks: list[TuningTask]) -> SiblingRecords:
    """Each task's seeds: the siblings' (name -> store directory) SEEDS_PER_TASK best schedules, ranked across
    siblings by their time over the best of their own sibling (the devices' speeds differ). The prior is left
    to `load_prior`."""
    stores = {name: RankedStore(directory) for name, directory in siblings.items()}
    result = SiblingRecords(sources=list(siblings), stores=stores)
    for task in tasks:
        ranked: list[tuple[float, Trace]] = []
        for store in stores.values():
            records = store.best(task, SEEDS_PER_TASK)
            if records:
                best = max(mean_seconds(records[0].run_secs), 1e-12)  # a 0 s record must not divide by zero
                ranked += [(mean_seconds(r.run_secs) / best, r.trace) for r in records]
        ranked.sort(key=lambda pair: pair[0])
        result.seeds[tvm_ffi.structural_hash(task.mod)] = [trace for _, trace in ranked[:SEEDS_PER_TASK]]
    return result


def load_sibling_records(siblings: Mapping[str, Path], tasks: list[TuningTask], target: tvm.target.Target,
                         num_threads: int) -> SiblingRecords:
    """The seeds and the prior's rows at once (see `SiblingRecords`)."""
    result = load_sibling_seeds(siblings, tasks)
    result.load_prior(tasks, target, num_threads)
    return result


def tuning_context(task: TuningTask, target: tvm.target.Target, num_threads: int) -> ms.TuneContext:
    """A tuning context of the task for `target`: its postprocessors check a replayed schedule."""
    register_tensor_intrinsics(target)
    return ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                          search_strategy="evolutionary", task_name=task.name, num_threads=num_threads)


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
