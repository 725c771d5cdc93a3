"""Transfer from sibling devices: what the siblings measured, loaded for the device being tuned.

A sibling is another device of the fleet (same ISA family) whose record store already holds
measurements of the same workloads. Three things carry over to the device being tuned:

- seeds: the siblings' best schedules for each task are replayed for this device's target
  and measured first (`search_strategy.seeded.SeededSearch`, wrapping either search strategy);
- a prior: a ranker trained on the siblings' records (`SiblingRecords.groups`, one ranking
  group per sibling and task, since the devices' speeds differ) predicts from the first batch;
- adaptation and a guard (`cost_model.transfer.TransferCostModel`, "warm" or "momentum").

This module loads the first two from the siblings' stores; `TransferStats` is what transfer did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Trace

from edgetune.tuning.analyzer.space import replay
from edgetune.tuning.cost_model.ranking import Groups, RankingCostModel
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.intrinsics import register_tensor_intrinsics
from edgetune.tuning.measurements import FAILED, mean_seconds, measure_candidate
from edgetune.tuning.tasks import TuningTask

SEEDS_PER_TASK = 4
"""Sibling schedules re-measured first for each task (the best ones, across siblings)."""
PRIOR_RECORDS_PER_TASK = 128
"""Best records per sibling and task the prior is trained on."""


@dataclass
class SiblingRecords:
    """What the siblings measured of this device's tasks."""

    sources: list[str]
    groups: Groups = field(default_factory=dict)  # prior's training data, per sibling and task
    seeds: dict[int, list[Trace]] = field(default_factory=dict)  # task workload hash -> traces, best first
    records_used: int = 0

    @property
    def empty(self) -> bool:
        return not self.groups


def load_sibling_records(siblings: Mapping[str, RecordStore], tasks: list[TuningTask], target: tvm.target.Target,
                         num_threads: int) -> SiblingRecords:
    """Read the siblings' records of `tasks`: feature rows for the prior (each record replayed
    on this target and featurized as this device's candidates are) and the seed traces."""
    result = SiblingRecords(sources=list(siblings))
    featurizer = RankingCostModel(num_threads=num_threads)
    for task in tasks:
        ranked: list[tuple[float, Trace]] = []
        context = None
        for name, store in siblings.items():
            if not store.database.has_workload(task.mod):
                continue
            workload = store.database.commit_workload(task.mod)
            records = [r for r in store.database.get_top_k(workload, PRIOR_RECORDS_PER_TASK)
                       if mean_seconds(r.run_secs) < FAILED]
            if not records:
                continue
            if context is None:
                register_tensor_intrinsics(target)
                context = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                                         search_strategy="evolutionary", num_threads=num_threads)
                postprocs = list(context.space_generator.postprocs)
            best = max(mean_seconds(records[0].run_secs), 1e-12)  # a 0 s record must not divide by zero
            schedules, costs = [], []
            for i, record in enumerate(records):
                schedule = replay(task.mod, record.trace, postprocs, seed=i + 1)
                if schedule is not None:
                    schedules.append(schedule)
                    costs.append(mean_seconds(record.run_secs))
                    ranked.append((costs[-1] / best, record.trace))
            if schedules:
                rows = featurizer.features(context, [measure_candidate(s) for s in schedules])
                result.groups[f"{name}/{tvm_ffi.structural_hash(task.mod)}"] = (list(rows), costs)
                result.records_used += len(schedules)
        ranked.sort(key=lambda pair: pair[0])
        result.seeds[tvm_ffi.structural_hash(task.mod)] = [trace for _, trace in ranked[:SEEDS_PER_TASK]]
    return result


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
