"""What measuring a candidate takes and gives: the candidate to send, and its mean run time.

Shared by the record store, the cost models, the search strategies and schedule selection, so none
of them imports another for these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import TypeVar

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

REMEASURES = 2
"""Re-measurements of a disturbed timing at most; the quietest of all of them is kept."""


@dataclass
class NoiseCounts:
    """How often this machine disturbed the timings: the tuning's measure of a busy machine."""

    disturbed: int = 0  # candidates whose first timing was disturbed, and so re-measured
    still_disturbed: int = 0  # ...and that no re-measurement gave undisturbed


def is_disturbed(run_secs: Sequence) -> bool:
    """True for a timing of several runs whose mean lies well above their median (see the constant)."""
    seconds = [float(s) for s in run_secs or []]
    if len(seconds) < 3 or mean_seconds(seconds) == FAILED:
        return False
    return sum(seconds) / len(seconds) > DISTURBED_MEAN_OVER_MEDIAN * median(seconds)


def quietest_timing(first: T, measure_again: Callable[[], T], counts: NoiseCounts,
                    seconds: Callable[[T], Sequence] = lambda timing: timing) -> T:
    """`first`, or where it was disturbed the one of lowest mean of it and up to REMEASURES more timings of
    the same candidate, stopping at the first undisturbed one; `seconds` reads a timing's run times. A
    re-measurement that raises or fails ends the retries.

    Spikes only add time, so the lowest mean is the nearest to the candidate's own: left as it was, a
    disturbed timing ranks a good schedule below worse ones, and the search loses it."""
    if not is_disturbed(seconds(first)):
        return first
    counts.disturbed += 1
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
    counts.still_disturbed += 1
    return quietest


def measure_candidate(schedule: Schedule) -> MeasureCandidate:
    return MeasureCandidate(schedule, ArgInfo.from_entry_func(schedule.mod, remove_preproc=True))
