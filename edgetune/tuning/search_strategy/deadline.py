"""A round that ends by the budget's deadline: its next batch is sent only if at least half of it fits.

The task scheduler cuts a round's trials to what fits at the task's pace so far, but a round's batches also
cost a fixed part each (drafting, a population evolved), so the last round of a budget ran past it: in a
6-minute ResNet-18 build a Winograd convolution's round started with 19 s left, its first batch of 8 took 15 s
and its second, started with 4 s left, 15 s more (the build ended 21 s after its 360). Between batches the
pace of the batch just measured is known: the next is sent when at least half of it fits before the deadline,
so a round ends within half a batch of it either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.search_strategy import PySearchStrategy


@dataclass
class RoundCut:
    """Whether the deadline ended the round before its trials were sent (shared with the strategy's clones)."""

    cut: bool = False


def expected_batch_s(last_batch_s: float, last_batch_size: int, trials_left: int, per_iter: int) -> float:
    """Seconds the next batch is expected to take at the last batch's pace per candidate: the next one is at
    most `per_iter` and the round's trials left (draft-verify's batches grow: 8, then 16)."""
    return last_batch_s / max(last_batch_size, 1) * min(per_iter, trials_left)


@dataclass
class BatchPace:
    """A round's batches as they are sent: whether the next still fits before `deadline` (a
    `time.monotonic()` instant). The first always does (no pace yet)."""

    deadline: float
    trials_left: int
    per_iter: int
    batch_started: float | None = None
    batch_size: int = 0

    def next_fits(self, now: float) -> bool:
        if self.batch_started is None or self.trials_left <= 0:
            return True
        expected = expected_batch_s(now - self.batch_started, self.batch_size, self.trials_left, self.per_iter)
        return now + expected / 2 <= self.deadline

    def sent(self, now: float, size: int) -> None:
        self.batch_started, self.batch_size = now, size
        self.trials_left -= size


@derived_object
class EndsByDeadline(PySearchStrategy):
    """`inner`'s batches, until the next would end more than half past `deadline` (a `time.monotonic()`
    instant); then the round ends as if the search had no candidate left, and `cut` says why."""

    def __init__(self, inner, deadline: float, cut: RoundCut):
        self.inner = inner
        self.deadline = deadline
        self.cut = cut

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.pace = BatchPace(self.deadline, int(max_trials), int(num_trials_per_iter))
        self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)

    def generate_measure_candidates(self):
        now = time.monotonic()
        if not self.pace.next_fits(now):
            self.cut.cut = True
            return None
        candidates = self.inner.generate_measure_candidates()
        if candidates:
            self.pace.sent(now, len(candidates))
        return candidates

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.inner.notify_runner_results(measure_candidates, results)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def clone(self) -> EndsByDeadline:
        return EndsByDeadline(self.inner.clone(), self.deadline, self.cut)
