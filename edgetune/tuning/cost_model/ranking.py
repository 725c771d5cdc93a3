"""The learned cost model (the verifier of draft-then-verify search): XGBoost that ranks.

Features are TVM's per-store features (Ansor's, `PerStoreFeature`), aggregated per candidate
(sum and max over its stores, plus the store count) so one row describes one program. Labels
are throughput normalized per task (best latency of the task / latency; failed runs 0) and the
objective is `rank:pairwise`, as in AutoTVM: only the order within a task matters, so tasks of
very different sizes train one model. It is refit on everything the target has measured before it ranks a
task whose latest measurements it has not learned, or once that data grew by REFIT_GROWTH (`fit_if_stale`), on
as many of its threads as other programs leave cores free (`fit_threads`); `save`/`load` keep it (model and
training data) beside the target's record store after every batch.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.cost_model import PyCostModel
from tvm.s_tir.meta_schedule.feature_extractor import FeatureExtractor, PerStoreFeature
from tvm.s_tir.meta_schedule.runner import RunnerResult
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate
from tvm.s_tir.meta_schedule.tune_context import TuneContext

from edgetune.machine_load import OtherLoad
from edgetune.tuning.measurements import FAILED, mean_seconds

if TYPE_CHECKING:
    import xgboost as xgb

_SHORTEST_RUN_S = 1e-12

_PARAMS = {
    "objective": "rank:pairwise",
    "max_depth": 6,
    "eta": 0.2,
    "min_child_weight": 1,
    "subsample": 1.0,
    "lambda": 1.0,
    "verbosity": 0,
}


REFIT_GROWTH = 0.25
"""A model whose training data grew by this share since its fit is refit before it ranks any task. Refit after
every batch, a 4-minute MobileNet-V2 build (34 tasks, 159 trials, 25 rounds) spent 25 s of its 77 s of rounds
fitting while the builders waited, and draft-verify consulted none of those fits (it asks only for tasks with 16
measurements). A task's next round comes about as many rounds later as the model has tasks, so the fits a
ranking needs are those of the task it ranks (its own measurements first) and of data grown enough to change
the ranking of the others."""

Groups = dict[str, tuple[list[np.ndarray], list[float]]]
"""Training data: per task (or per device and task), feature rows and measured seconds."""


def task_key(context: TuneContext) -> str:
    """The task a candidate belongs to: its workload's structural hash."""
    return str(tvm_ffi.structural_hash(context.mod))


def ranking_data(groups: Groups) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """Rows, labels (throughput relative to the group's best; failures 0) and group sizes."""
    rows, labels, sizes = [], [], []
    for features, costs in groups.values():
        # a run timed at 0 s (a kernel below the timer's resolution) would divide by zero
        cost = np.maximum(np.nan_to_num(np.asarray(costs, dtype=float), nan=FAILED, posinf=FAILED), _SHORTEST_RUN_S)
        finite = np.isfinite(cost)
        if not finite.any():
            continue
        best = cost[finite].min()
        labels.append(np.where(finite, best / np.where(finite, cost, 1.0), 0.0))
        rows.append(np.stack(features))
        sizes.append(len(costs))
    if not rows or sum(sizes) < 2:
        return None
    return np.concatenate(rows), np.concatenate(labels), sizes


def train_ranker(groups: Groups, num_threads: int, rounds: int, params: dict | None = None,
                 base_margin: Callable[[np.ndarray], np.ndarray] | None = None) -> xgb.Booster | None:
    """An XGBoost ranker on `groups`, or None without two measurements; `base_margin` boosts on
    top of another model's scores (a residual model)."""
    import xgboost as xgb

    data = ranking_data(groups)
    if data is None:
        return None
    rows, labels, sizes = data
    matrix = xgb.DMatrix(rows, label=labels)
    matrix.set_group(sizes)
    if base_margin is not None:
        matrix.set_base_margin(base_margin(rows))
    return xgb.train(dict(params or _PARAMS, nthread=num_threads, seed=0), matrix, num_boost_round=rounds)


def rank(scores: np.ndarray) -> np.ndarray:
    """Scores as ranks in [0, 1] (1: best; ties share their mean rank), so scorers add up."""
    if len(scores) < 2:
        return np.ones(len(scores))
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (starts + (counts - 1) / 2.0)[inverse] / (len(scores) - 1)


def aggregate(per_store: np.ndarray) -> np.ndarray:
    """One row per candidate from its [stores, features] matrix: sum, max, and the store count."""
    if per_store.shape[0] == 0:
        return np.zeros(2 * per_store.shape[1] + 1, dtype=np.float32)
    return np.concatenate([per_store.sum(axis=0), per_store.max(axis=0), [per_store.shape[0]]]).astype(np.float32)


@derived_object
class RankingCostModel(PyCostModel):
    """XGBoost `rank:pairwise` on aggregated per-store features, trained online (see module doc).

    `path`: where the model keeps itself; it is loaded from there when present and saved there
    after every refit, so a target's model grows with its records across builds.
    """

    def __init__(self, *, num_threads: int = 1, rounds: int = 120, path: Path | None = None,
                 extractor: FeatureExtractor | None = None):
        super().__init__()
        self.extractor = extractor or PerStoreFeature(extract_workload=True)
        self.num_threads = num_threads
        self.rounds = rounds
        self.path = path
        self.groups: Groups = {}
        self.booster = None
        self.fitted: dict[str, int] = {}  # rows of each task the booster learned
        self.load_beside = OtherLoad()
        if path is not None and Path(path).exists():
            self.load(str(path))

    @property
    def trained(self) -> bool:
        return self.booster is not None

    @property
    def size(self) -> int:
        return sum(len(costs) for _, costs in self.groups.values())

    def features(self, context: TuneContext, candidates: list[MeasureCandidate]) -> np.ndarray:
        """[N, F] one feature row per candidate."""
        return np.stack([aggregate(t.numpy()) for t in self.extractor.extract_from(context, candidates)])

    def update(self, context: TuneContext, candidates: list[MeasureCandidate], results: list[RunnerResult]) -> None:
        if candidates:
            self.add(task_key(context), self.features(context, candidates), results)

    def add(self, key: str, rows: np.ndarray, results: list[RunnerResult]) -> None:
        """Keep measured candidates (feature rows) of the task `key` and save them; the model learns them
        before it next ranks (`fit_if_stale`)."""
        features, costs = self.groups.setdefault(key, ([], []))
        for row, result in zip(rows, results):
            features.append(row)
            costs.append(_cost(result))
        if self.path is not None:
            self.save(str(self.path))

    def predict(self, context: TuneContext, candidates: list[MeasureCandidate]) -> np.ndarray:
        """Scores, higher is faster (zeros until measurements have trained the model)."""
        if not candidates:
            return np.zeros(0)
        return self.scores(task_key(context), self.features(context, candidates))

    def scores(self, key: str, rows: np.ndarray) -> np.ndarray:
        """`predict` for feature rows of the task `key`, refit first where the model is stale for it."""
        self.fit_if_stale(key)
        if self.booster is None:
            return np.zeros(len(rows))
        return self.predict_rows(rows)

    def fit_if_stale(self, key: str) -> bool:
        """Refit before ranking the task `key` where the model lacks some of its measurements, or where all
        tasks' data grew by REFIT_GROWTH since the fit; whether it refit."""
        learned = sum(self.fitted.values())
        own_unseen = self.fitted.get(key, 0) < len(self.groups.get(key, ((), ()))[1])
        if not own_unseen and self.size - learned < REFIT_GROWTH * max(learned, 1):
            return False
        self._train()
        return True

    def predict_rows(self, rows: np.ndarray) -> np.ndarray:
        import xgboost as xgb

        return self.booster.predict(xgb.DMatrix(rows)).astype("float64")

    def fit_threads(self) -> int:
        """Threads for the next fit: `num_threads`, fewer while other programs held cores since the last reading.

        Beside one busy loop on this 2-core VM a fit on two threads took twice as long as on one (2.7 against
        1.5 s on 200 rows of 345 features, 5.0-5.4 against 2.5 s on 450): each of its boosting rounds waits at its
        end for the thread that shares its core with the loop, as a kernel's parallel loops do
        (machine_load.py). Idle, two threads fit 200 rows in 1.0 s."""
        return self.load_beside.free_threads(self.num_threads)

    def _train(self) -> None:
        self.booster = train_ranker(self.groups, self.fit_threads(), self.rounds)
        self.fitted = {key: len(costs) for key, (_, costs) in self.groups.items()}

    def merge(self, other: RankingCostModel) -> None:
        """Add the other model's training data (rows this one lacks), refit and save: importing a
        store's records must not lose what either side learned."""
        for key, (rows, costs) in other.groups.items():
            features, known_costs = self.groups.setdefault(key, ([], []))
            known = {(row.tobytes(), cost) for row, cost in zip(features, known_costs)}
            for row, cost in zip(rows, costs):
                if (row.tobytes(), cost) not in known:
                    features.append(row)
                    known_costs.append(cost)
        self._train()
        if self.path is not None:
            self.save(str(self.path))

    def save(self, path: str) -> None:
        """Model and training data in one .npz (training data, so later refits keep it)."""
        buffer = io.BytesIO()
        keys = list(self.groups)
        arrays = {
            "meta": np.frombuffer(json.dumps({"keys": keys, "rounds": self.rounds,
                                              "fitted": [self.fitted.get(key, 0) for key in keys]}).encode(),
                                  dtype=np.uint8),
            "model": np.frombuffer(bytes(self.booster.save_raw("ubj")), dtype=np.uint8)
            if self.booster is not None else np.zeros(0, dtype=np.uint8),
        }
        for i, key in enumerate(keys):
            features, costs = self.groups[key]
            arrays[f"x{i}"] = np.stack(features)
            arrays[f"y{i}"] = np.asarray(costs, dtype=float)
        np.savez(buffer, **arrays)
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(buffer.getvalue())
        partial.replace(target)

    def load(self, path: str) -> None:
        import xgboost as xgb

        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            self.rounds = int(meta["rounds"])
            self.groups = {
                key: (list(data[f"x{i}"]), [float(c) for c in data[f"y{i}"]]) for i, key in enumerate(meta["keys"])
            }
            model = bytes(data["model"])
        if model:
            self.booster = xgb.Booster(params={"nthread": self.num_threads})
            self.booster.load_model(bytearray(model))
        else:
            self.booster = None
        # a model saved before its fits were counted had learned all of its data; without a model, nothing
        counts = [len(costs) for _, costs in self.groups.values()]
        fitted = (meta.get("fitted") or counts) if model else [0] * len(counts)
        self.fitted = dict(zip(self.groups, (int(n) for n in fitted)))


def _cost(result: RunnerResult) -> float:
    return FAILED if result.error_msg is not None else mean_seconds(result.run_secs)
