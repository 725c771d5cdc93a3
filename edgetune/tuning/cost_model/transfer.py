"""The learned model of a device with siblings: the siblings' prior, adapted to this device.

Adaptation is one of two modes:
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

A guard: after each batch the prior's scores of the task's measured candidates are compared
with the measured order (Spearman); while the correlation is below GUARD_MIN_CORRELATION over
at least GUARD_MIN_POINTS measurements, the task is predicted by this device's own model
alone, as a run from scratch would be, and draft-verify search stops trusting the prior.
The prior's data, the siblings' records, is loaded by `edgetune.tuning.transfer.siblings`.
"""

from __future__ import annotations

import logging
from typing import Literal

import numpy as np
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.cost_model import PyCostModel

from edgetune.tuning.cost_model.ranking import RankingCostModel, rank, task_key, train_ranker
from edgetune.tuning.transfer.siblings import SiblingRecords, TransferStats

logger = logging.getLogger(__name__)

TransferMode = Literal["momentum", "warm", "off"]

MOMENTUM = 0.99
"""MoA-Pruner's momentum coefficient."""
RESIDUAL_ROUNDS = 40
RESIDUAL_PARAMS = {"objective": "rank:pairwise", "max_depth": 4, "eta": 0.2, "min_child_weight": 1,
                   "lambda": 1.0, "verbosity": 0}
"""The residual trees fit a few measurements per task: shallower and fewer than a full model."""
GUARD_MIN_POINTS = 6
GUARD_MIN_CORRELATION = 0.1


@derived_object
class TransferCostModel(PyCostModel):
    """The learned model of a device with siblings (see the module doc for the two modes)."""

    def __init__(self, local: RankingCostModel, siblings: SiblingRecords, mode: TransferMode, stats: TransferStats):
        super().__init__()
        self.local = local
        self.mode = mode
        self.stats = stats
        self.adopt_prior(siblings)  # none yet where the siblings' records are read later (tune._load_prior)
        self.checks: dict[str, tuple[list[float], list[float]]] = {}  # task -> prior scores, measured seconds
        self.distrusted: set[str] = set()

    def adopt_prior(self, siblings: SiblingRecords) -> None:
        """The siblings' prior, once their records are loaded (`SiblingRecords.load_prior`): until then the
        device's own model predicts, as from scratch. The adaptation starts from this moment: the first
        residual is fit on all of the device's measurements so far."""
        self.sibling_groups = siblings.groups
        self.prior = train_ranker(siblings.groups, self.local.fit_threads(), self.local.rounds)
        self.momentum: list[tuple[object, float]] = []  # residual rankers folded into the momentum copy
        self.online = None  # g: the residual fit over the momentum copy at the last update (momentum mode)
        self.pooled = None  # the ranker on sibling + device data (warm mode)

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
        model keeps them (and learns them before it next ranks), the guard checks the prior against them, and
        the transfer refits on the threads one reading of the load gives (a second reading would span only
        the first fit: too short to tell a busy core)."""
        self.local.add(key, rows, results)
        if self.prior is None:
            return
        threads = self.local.fit_threads()
        self._check(key, task_name, rows, self.local.groups[key][1][-len(rows):])
        if self.mode == "warm":
            self.pooled = train_ranker({**self.sibling_groups, **self.local.groups}, threads, self.local.rounds)
            return
        if self.online is not None:  # f_m <- b f_m + (1-b) f_online = f_m + (1-b) g
            self.momentum.append((self.online, 1.0 - MOMENTUM))
        self.online = train_ranker(self.local.groups, threads, RESIDUAL_ROUNDS, RESIDUAL_PARAMS,
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
