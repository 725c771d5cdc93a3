"""Timings disturbed by other work on the machine are taken again, and the quietest is kept."""

from __future__ import annotations

import pytest

from edgetune.tuning.measurements import REMEASURES, NoiseCounts, is_disturbed, quietest_timing

QUIET = [1.0e-4] * 9 + [1.02e-4]
PRE_EMPTED = [1.0e-4] * 9 + [5.0e-4]  # one run of ten lost its core to another process: the mean is 1.4x


class Timings:
    """Hands out the given timings one per call, as a runner measuring the same candidate again would."""

    def __init__(self, *timings: list[float]) -> None:
        self.left = list(timings)
        self.calls = 0

    def __call__(self) -> list[float]:
        self.calls += 1
        taken = self.left.pop(0)
        if isinstance(taken, Exception):
            raise taken
        return taken


def test_a_quiet_timing_is_kept_without_measuring_again() -> None:
    counts, again = NoiseCounts(), Timings()
    assert quietest_timing(QUIET, again, counts) is QUIET
    assert again.calls == 0 and counts == NoiseCounts()


def test_a_pre_empted_run_makes_the_candidate_measured_again_and_the_quiet_timing_kept() -> None:
    counts, again = NoiseCounts(), Timings(QUIET)
    assert quietest_timing(PRE_EMPTED, again, counts) == QUIET
    assert again.calls == 1 and counts == NoiseCounts(disturbed=1, still_disturbed=0)


def test_a_candidate_disturbed_every_time_keeps_its_lowest_mean_and_is_counted() -> None:
    worse = [1.0e-4] * 8 + [9.0e-4, 9.0e-4]
    slightly = [1.0e-4] * 9 + [3.0e-4]
    counts, again = NoiseCounts(), Timings(worse, slightly)
    assert quietest_timing(PRE_EMPTED, again, counts) == slightly
    assert again.calls == REMEASURES and counts == NoiseCounts(disturbed=1, still_disturbed=1)


def test_a_re_measurement_that_fails_ends_the_retries_and_keeps_what_was_measured() -> None:
    counts, again = NoiseCounts(), Timings(TimeoutError("killed after 30 s"), QUIET)
    assert quietest_timing(PRE_EMPTED, again, counts) == PRE_EMPTED
    assert again.calls == 1 and counts.still_disturbed == 1


def test_a_slower_but_quiet_re_measurement_stops_the_retries_and_the_lower_mean_stays() -> None:
    slow_quiet = [1.6e-4] * 10
    counts, again = NoiseCounts(), Timings(slow_quiet, QUIET)
    assert quietest_timing(PRE_EMPTED, again, counts) == PRE_EMPTED
    assert again.calls == 1 and counts == NoiseCounts(disturbed=1, still_disturbed=0)


@pytest.mark.parametrize("run_secs", [[], [1.0e-4, 9.0e-4], [1e10] * 10, [1e10] * 9 + [1.0e-4]],
                         ids=["none", "two-runs", "failed", "failed-mostly"])
def test_timings_without_a_median_to_compare_or_of_failed_runs_are_not_disturbed(run_secs: list[float]) -> None:
    assert not is_disturbed(run_secs)


def test_a_runners_result_is_read_through_the_given_accessor() -> None:
    first, quiet = ("first", PRE_EMPTED), ("again", QUIET)
    counts = NoiseCounts()
    assert quietest_timing(first, Timings(quiet), counts, seconds=lambda result: result[1]) == quiet
