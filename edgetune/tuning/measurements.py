"""What measuring a candidate takes and gives: the candidate to send, and its mean run time.

Shared by the record store, the cost models, the search strategies and schedule selection, so none
of them imports another for these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol, TypeVar, runtime_checkable

from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

FAILED = float("inf")

T = TypeVar("T")

_FAILED_RUN_SECONDS = 1e9
"""MetaSchedule records a run that failed as 1e10 seconds."""


def mean_seconds(run_secs) -> float:
    """Mean measured run time of a record or runner result; FAILED for a failed or missing one."""
    seconds = [float(s) for s in run_secs or []]
    mean = sum(seconds) / len(seconds) if seconds else FAILED
    return mean if mean < _FAILED_RUN_SECONDS else FAILED


DISTURBED_MEAN_OVER_MEDIAN = 1.10
"""A candidate's timing whose mean exceeds its median by more than this was disturbed: something else on
the machine took the CPU during a run or two (one run of ten at 5x the others moves the mean 40%), and a
store ranks by the mean. In an idle ResNet-18 build's store 9% of the candidates were so."""

NEAR_BEST = 1.25
"""A disturbed timing is measured again only when its median (the runs the disturbance left alone) is
within this factor of the task's best so far: on a busy machine most timings are disturbed, and a
candidate far behind the best ranks there whatever its spikes; measuring it again only costs trials."""

REMEASURES = 2
"""Re-measurements of a disturbed timing at most; the quietest of all of them is kept."""


def is_disturbed(run_secs: Sequence) -> bool:
    """True for a timing of several runs whose mean lies well above their median (see the constant)."""
    seconds = [float(s) for s in run_secs or []]
    if len(seconds) < 3 or mean_seconds(seconds) == FAILED:
        return False
    return sum(seconds) / len(seconds) > DISTURBED_MEAN_OVER_MEDIAN * median(seconds)


@dataclass
class NoiseCounts:
    """How often other work on the machine disturbed a task's timings (the tuning's measure of a busy machine)."""

    disturbed: int = 0  # candidates whose first timing was disturbed
    remeasured: int = 0  # ...near enough the best to be measured again
    still_disturbed: int = 0  # ...and that no re-measurement gave undisturbed
    on_fewer_threads: int = 0  # candidates timed on fewer threads than the target's: other programs held cores
    slow_window: int = 0  # candidates timed while a reference kernel ran slow beside them (slow_windows.py)
    slow_window_retimed: int = 0  # ...so timed again once the machine read quiet
    slow_window_still: int = 0  # ...and not timed in a quiet window after all

    @classmethod
    def total(cls, counts: Iterable[NoiseCounts]) -> NoiseCounts:
        summed = cls()
        for each in counts:
            for name, value in vars(each).items():
                setattr(summed, name, getattr(summed, name) + value)
        return summed


@dataclass
class TimingNoise:
    """A runner's watch over disturbed timings: which to measure again, counted into the task being tuned."""

    best_s: float | None = None
    """The current task's best mean so far: set when its round starts, lowered by each timing."""
    counts: NoiseCounts = field(default_factory=NoiseCounts)
    """The current task's counts: its outcome's own, handed over when its round starts (`watch`)."""

    def watch(self, counts: NoiseCounts, best_s: float | None) -> None:
        """A round of another task starts: its timings count into `counts`, compared with its `best_s`."""
        self.counts, self.best_s = counts, best_s

    def quietest(self, first: T, measure_again: Callable[[], T],
                 seconds: Callable[[T], Sequence] = lambda timing: timing) -> T:
        """`first`, or where it was disturbed near the best the one of lowest mean of it and up to REMEASURES
        more timings of the same candidate, stopping at the first undisturbed one; `seconds` reads a
        timing's run times. A re-measurement that raises or fails ends the retries.

        Spikes only add time, so the lowest mean is the nearest to the candidate's own: left as it was, a
        disturbed timing ranks a good schedule below worse ones, and the search loses it."""
        quietest = first
        if is_disturbed(seconds(first)):
            self.counts.disturbed += 1
            if self.best_s is None or median(float(s) for s in seconds(first)) <= NEAR_BEST * self.best_s:
                quietest = self._measured_again(first, measure_again, seconds)
        mean = mean_seconds(seconds(quietest))
        if mean < FAILED and (self.best_s is None or mean < self.best_s):
            self.best_s = mean
        return quietest

    def _measured_again(self, first: T, measure_again: Callable[[], T], seconds: Callable[[T], Sequence]) -> T:
        self.counts.remeasured += 1
        quietest = first
        for _ in range(REMEASURES):
            try:
                again = measure_again()
            except Exception:  # the candidate failed this time: keep the timings it gave before
                break
            if mean_seconds(seconds(again)) < mean_seconds(seconds(quietest)):
                quietest = again
            if not is_disturbed(seconds(again)):
                return quietest
        self.counts.still_disturbed += 1
        return quietest


@runtime_checkable
class WatchesTimingNoise(Protocol):
    """A runner that measures disturbed timings again (edgetune's local and RPC runners; TVM's own do not)."""

    noise: TimingNoise


def measure_candidate(schedule: Schedule) -> MeasureCandidate:
    return MeasureCandidate(schedule, ArgInfo.from_entry_func(schedule.mod, remove_preproc=True))
