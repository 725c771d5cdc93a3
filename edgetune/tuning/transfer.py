"""Transfer from sibling devices: warm start, and momentum online adaptation for trees.

A sibling is another device of the fleet (same ISA family) whose record store already holds
measurements of the same workloads. Three things carry over to the device being tuned:

- seeds: the siblings' best schedules for each task are replayed for this device's target
  and measured first (`SeededSearch`, wrapping either search strategy);
- a prior: a ranker trained on the siblings' records (`SiblingRecords.groups`, one ranking
  group per sibling and task, since the devices' speeds differ) predicts from the first batch;
- adaptation (`TransferCostModel`), one of two modes:
  * "warm": the siblings' data and this device's measurements are pooled and one ranker is
    refit after every batch (AutoTVM's history transfer);
  * "momentum": MoA-Pruner's rule, restated for gradient-boosted trees. MoA keeps a momentum
    copy theta_m of the pretrained weights; at each update it fine-tunes a fresh model from
    theta_m on the target's data (theta_online) and sets theta_m <- b theta_m + (1-b) theta_online.
    Trees have no weights to average, but the same rule holds in function space: fine-tuning
    from f_m is boosting residual trees g on the target's data with f_m's scores as base
    margin, so f_online = f_m + g and b f_m + (1-b) f_online = f_m + (1-b) g. edgetune keeps
    f_m = prior + (1-b) * sum of past residuals (exact, no distillation) and predicts with
    f_online = f_m + g. With b = 0.99 the prior dominates the momentum copy for the first
    tens of updates, as in MoA; the residual g is what adapts to the device at once.
- a guard: after each batch the prior's scores of the task's measured candidates are compared
  with the measured order (Spearman); while the correlation is below GUARD_MIN_CORRELATION over
  at least GUARD_MIN_POINTS measurements, the task is predicted by this device's own model
  alone, as a run from scratch would be, and draft-verify search stops trusting the prior.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.cost_model import PyCostModel
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate, PySearchStrategy
from tvm.s_tir.schedule import Trace

from edgetune.tuning.analyzer.space import replay
from edgetune.tuning.cost_model import FAILED, Groups, RankingCostModel, mean_seconds, task_key, train_ranker
from edgetune.tuning.draft_verify import rank
from edgetune.tuning.intrinsics import register_tensor_intrinsics
from edgetune.tuning.records import RecordStore
from edgetune.tuning.tasks import TuningTask

logger = logging.getLogger(__name__)

TransferMode = Literal["momentum", "warm", "off"]

SEEDS_PER_TASK = 4
"""Sibling schedules re-measured first for each task (the best ones, across siblings)."""
PRIOR_RECORDS_PER_TASK = 128
"""Best records per sibling and task the prior is trained on."""
MOMENTUM = 0.99
"""MoA-Pruner's momentum coefficient."""
RESIDUAL_ROUNDS = 40
RESIDUAL_PARAMS = {"objective": "rank:pairwise", "max_depth": 4, "eta": 0.2, "min_child_weight": 1,
                   "lambda": 1.0, "verbosity": 0}
"""The residual trees fit a few measurements per task: shallower and fewer than a full model."""
GUARD_MIN_POINTS = 6
GUARD_MIN_CORRELATION = 0.1


def measure_candidate(schedule: Schedule) -> MeasureCandidate:
    return MeasureCandidate(schedule, ArgInfo.from_entry_func(schedule.mod, remove_preproc=True))


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
    seeds_measured: int = 0  # sibling schedules re-measured on this device
    seed_best: dict[str, float] = field(default_factory=dict)  # task -> best seconds among its seeds
    distrusted: set[str] = field(default_factory=set)  # tasks whose prior the guard set aside


@derived_object
class TransferCostModel(PyCostModel):
    """The learned model of a device with siblings (see the module doc for the two modes)."""

    def __init__(self, local: RankingCostModel, siblings: SiblingRecords, mode: TransferMode, stats: TransferStats):
        super().__init__()
        self.local = local
        self.mode = mode
        self.stats = stats
        self.sibling_groups = siblings.groups
        self.prior = train_ranker(siblings.groups, local.num_threads, local.rounds)
        self.momentum: list[tuple[object, float]] = []  # residual rankers folded into the momentum copy
        self.online = None  # g: the residual fit over the momentum copy at the last update (momentum mode)
        self.pooled = None  # the ranker on sibling + device data (warm mode)
        self.checks: dict[str, tuple[list[float], list[float]]] = {}  # task -> prior scores, measured seconds
        self.distrusted: set[str] = set()

    def trusted(self, key: str) -> bool:
        """Whether the sibling prior ranks this task's candidates (draft-verify weighs it fully)."""
        return self.prior is not None and key not in self.distrusted

    def load(self, path: str) -> None:
        self.local.load(path)

    def save(self, path: str) -> None:
        self.local.save(path)

    def update(self, context, candidates, results) -> None:
        if candidates:
            self.learn(task_key(context), str(context.task_name), self.local.features(context, candidates), results)

    def learn(self, key: str, task_name: str, rows: np.ndarray, results: list) -> None:
        """This device's measurements of a task (feature rows and runner results): the device's own
        model learns them, the guard checks the prior against them, and the transfer refits."""
        self.local.add(key, rows, results)
        if self.prior is None:
            return
        self._check(key, task_name, rows, self.local.groups[key][1][-len(rows):])
        if self.mode == "warm":
            self.pooled = train_ranker({**self.sibling_groups, **self.local.groups}, self.local.num_threads,
                                       self.local.rounds)
            return
        if self.online is not None:  # f_m <- b f_m + (1-b) f_online = f_m + (1-b) g
            self.momentum.append((self.online, 1.0 - MOMENTUM))
        self.online = train_ranker(self.local.groups, self.local.num_threads, RESIDUAL_ROUNDS, RESIDUAL_PARAMS,
                                   base_margin=self._momentum_margin)

    def predict(self, context, candidates) -> np.ndarray:
        if not candidates:
            return np.zeros(0)
        key = task_key(context)
        if not self.trusted(key):
            return self.local.predict(context, candidates)
        return self.predict_rows(self.local.features(context, candidates))

    def predict_rows(self, rows: np.ndarray) -> np.ndarray:
        """The transferred model's scores (higher is faster) for feature rows."""
        if self.mode == "warm":
            return _margin(self.pooled or self.prior, rows)
        scores = self._momentum_margin(rows)
        if self.online is not None:
            scores = scores + _margin(self.online, rows)
        return scores

    def _momentum_margin(self, rows: np.ndarray) -> np.ndarray:
        scores = _margin(self.prior, rows)
        for booster, weight in self.momentum:
            scores = scores + weight * _margin(booster, rows)
        return scores

    def _check(self, key: str, task_name: str, rows: np.ndarray, costs: list[float]) -> None:
        """The guard: does the prior order this task's measurements as the device does?"""
        scores, measured = self.checks.setdefault(key, ([], []))
        scores.extend(_margin(self.prior, rows).tolist())
        measured.extend(costs)
        score, cost = np.array(scores), np.array(measured)
        finite = np.isfinite(cost)
        if finite.sum() < GUARD_MIN_POINTS:
            return
        correlation = spearman(score[finite], -cost[finite])
        if correlation < GUARD_MIN_CORRELATION and key not in self.distrusted:
            logger.info("%s: the siblings' model ranks this device's measurements with Spearman %.2f: "
                        "predicting from this device's own data", task_name, correlation)
            self.distrusted.add(key)
            self.stats.distrusted.add(task_name)
        elif correlation >= GUARD_MIN_CORRELATION and key in self.distrusted:
            self.distrusted.discard(key)
            self.stats.distrusted.discard(task_name)


def _margin(booster, rows: np.ndarray) -> np.ndarray:
    import xgboost as xgb

    return booster.predict(xgb.DMatrix(rows), output_margin=True).astype("float64")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation; 0 when either side is constant (no order to agree with)."""
    ra, rb = rank(a), rank(b)
    if np.ptp(ra) == 0 or np.ptp(rb) == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


@derived_object
class SeededSearch(PySearchStrategy):
    """Measures the siblings' best schedules of the task first, then hands over to `inner`.

    Seeds are skipped when the device's store already holds records of the task (a resumed
    build measured them in its first batch). `inner` gets the rest of the trial budget and sees
    the seeds' measurements in the database like any other record.
    """

    def __init__(self, inner, seeds: dict[int, list[Trace]], stats: TransferStats):
        self.inner = inner
        self.seeds = seeds
        self.stats = stats

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)
        self.context = context

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        mod = self.context.mod
        self.queue: list[Schedule] = []
        already = database is not None and database.has_workload(mod) and len(
            database.get_top_k(database.commit_workload(mod), 1)) > 0
        if not already:
            postprocs = list(self.context.space_generator.postprocs)
            programs: set[int] = set()
            for i, trace in enumerate(self.seeds.get(tvm_ffi.structural_hash(mod), [])):
                schedule = replay(mod, trace, postprocs, seed=i + 1)
                if schedule is not None and tvm_ffi.structural_hash(schedule.mod) not in programs:
                    programs.add(tvm_ffi.structural_hash(schedule.mod))
                    self.queue.append(schedule)
        self.queue = self.queue[: int(max_trials)]
        self.seeding = False
        self.inner.pre_tuning(int(max_trials) - len(self.queue), num_trials_per_iter, design_spaces, database,
                              cost_model)

    def generate_measure_candidates(self):
        if self.queue:
            batch, self.queue = self.queue, []
            self.seeding = True
            return [measure_candidate(s) for s in batch]
        return self.inner.generate_measure_candidates()

    def notify_runner_results(self, measure_candidates, results) -> None:
        if not self.seeding:
            self.inner.notify_runner_results(measure_candidates, results)
            return
        self.seeding = False
        self.stats.seeds_measured += len(results)
        seconds = [mean_seconds(r.run_secs) for r in results if r.error_msg is None and r.run_secs]
        if seconds and min(seconds) < FAILED:
            self.stats.seed_best[str(self.context.task_name)] = min(seconds)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def clone(self) -> SeededSearch:
        return SeededSearch(self.inner.clone(), self.seeds, self.stats)
