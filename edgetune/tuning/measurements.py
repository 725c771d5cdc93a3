"""What measuring a candidate takes and gives: the candidate to send, and its mean run time.

Shared by the record store, the cost models, the search strategies and schedule selection, so none
of them imports another for these helpers.
"""

from __future__ import annotations

from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

FAILED = float("inf")

_FAILED_RUN_SECONDS = 1e9
"""MetaSchedule records a run that failed as 1e10 seconds."""


def mean_seconds(run_secs) -> float:
    """Mean measured run time of a record or runner result; FAILED for a failed or missing one."""
    seconds = [float(s) for s in run_secs or []]
    mean = sum(seconds) / len(seconds) if seconds else FAILED
    return mean if mean < _FAILED_RUN_SECONDS else FAILED


def measure_candidate(schedule: Schedule) -> MeasureCandidate:
    return MeasureCandidate(schedule, ArgInfo.from_entry_func(schedule.mod, remove_preproc=True))
