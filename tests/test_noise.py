"""Timings disturbed by other work on the machine are taken again near the task's best, and the quietest kept."""

from __future__ import annotations

import pytest

from edgetune.tuning.measurements import (
    NEAR_BEST,
    REMEASURES,
    NoiseCounts,
    TimingNoise,
    WatchesTimingNoise,
    is_disturbed,
)

QUIET = [1.0e-4] * 9 + [1.02e-4]
PRE_EMPTED = [1.0e-4] * 9 + [5.0e-4]  # one run of ten lost its core to another process: the mean is 1.4x


class Timings:
    """Hands out the given timings one per call, as a runner measuring the same candidate again would."""

    def __init__(self, *timings: list[float] | Exception) -> None:
        self.left = list(timings)
        self.calls = 0

    def __call__(self) -> list[float]:
        self.calls += 1
        taken = self.left.pop(0)
        if isinstance(taken, Exception):
            raise taken
        return taken


def counts(noise: TimingNoise) -> tuple[int, int, int]:
    return noise.counts.disturbed, noise.counts.remeasured, noise.counts.still_disturbed


def test_a_quiet_timing_is_kept_without_measuring_again_and_lowers_the_best() -> None:
    noise, again = TimingNoise(best_s=2.0e-4), Timings()
    assert noise.quietest(QUIET, again) is QUIET
    assert again.calls == 0 and counts(noise) == (0, 0, 0)
    assert noise.best_s == pytest.approx(sum(QUIET) / len(QUIET))


def test_a_pre_empted_run_makes_the_candidate_measured_again_and_the_quiet_timing_kept() -> None:
    noise, again = TimingNoise(), Timings(QUIET)
    assert noise.quietest(PRE_EMPTED, again) == QUIET
    assert again.calls == 1 and counts(noise) == (1, 1, 0)


def test_a_candidate_disturbed_every_time_keeps_its_lowest_mean_and_is_counted() -> None:
    worse = [1.0e-4] * 8 + [9.0e-4, 9.0e-4]
    slightly = [1.0e-4] * 9 + [3.0e-4]
    noise, again = TimingNoise(), Timings(worse, slightly)
    assert noise.quietest(PRE_EMPTED, again) == slightly
    assert again.calls == REMEASURES and counts(noise) == (1, 1, 1)


def test_a_disturbed_candidate_far_behind_the_best_is_not_measured_again() -> None:
    far_behind = [x * 2 for x in PRE_EMPTED]  # its median alone is twice the best
    noise, again = TimingNoise(best_s=1.0e-4), Timings(QUIET)
    assert noise.quietest(far_behind, again) is far_behind
    assert again.calls == 0 and counts(noise) == (1, 0, 0) and noise.best_s == 1.0e-4
    near = [x * (NEAR_BEST - 0.05) for x in PRE_EMPTED]
    assert noise.quietest(near, Timings(QUIET)) == QUIET and counts(noise) == (2, 1, 0)


def test_a_re_measurement_that_fails_ends_the_retries_and_keeps_what_was_measured() -> None:
    noise, again = TimingNoise(), Timings(TimeoutError("killed after 30 s"), QUIET)
    assert noise.quietest(PRE_EMPTED, again) == PRE_EMPTED
    assert again.calls == 1 and counts(noise) == (1, 1, 1)


def test_a_slower_but_quiet_re_measurement_stops_the_retries_and_the_lower_mean_stays() -> None:
    slow_quiet = [1.6e-4] * 10
    noise, again = TimingNoise(), Timings(slow_quiet, QUIET)
    assert noise.quietest(PRE_EMPTED, again) == PRE_EMPTED
    assert again.calls == 1 and counts(noise) == (1, 1, 0)


@pytest.mark.parametrize("run_secs", [[], [1.0e-4, 9.0e-4], [1e10] * 10, [1e10] * 9 + [1.0e-4]],
                         ids=["none", "two-runs", "failed", "failed-mostly"])
def test_timings_without_a_median_to_compare_or_of_failed_runs_are_not_disturbed(run_secs: list[float]) -> None:
    assert not is_disturbed(run_secs)
    noise = TimingNoise()
    assert noise.quietest(run_secs, Timings()) is run_secs and counts(noise) == (0, 0, 0)


def test_a_runners_result_is_read_through_the_given_accessor() -> None:
    first, quiet = ("first", PRE_EMPTED), ("again", QUIET)
    assert TimingNoise().quietest(first, Timings(quiet), seconds=lambda result: result[1]) == quiet


def test_each_round_counts_into_its_own_tasks_counts_and_the_totals_add_up() -> None:
    """The runner's watch is handed the counts of the task whose round starts: nothing to subtract afterwards."""
    first_task, second_task, noise = NoiseCounts(), NoiseCounts(), TimingNoise()
    noise.watch(first_task, best_s=None)
    noise.quietest(PRE_EMPTED, Timings(QUIET))
    noise.watch(second_task, best_s=1.0e-4)
    noise.quietest([x * 2 for x in PRE_EMPTED], Timings())  # far behind this task's best: not measured again
    assert (first_task.disturbed, first_task.remeasured, second_task.disturbed, second_task.remeasured) == (1, 1, 1, 0)
    total = NoiseCounts.total([first_task, second_task])
    assert (total.disturbed, total.remeasured, total.still_disturbed) == (2, 1, 0)


def test_only_edgetunes_runners_watch_timing_noise() -> None:
    """(The runner alone: `local_builder_runner` would narrow this process's TVM threads for later tests.)"""
    from tvm.s_tir.meta_schedule.runner import LocalRunner

    from edgetune.tuning.local_runner import LocalCandidateRunner

    runner = LocalCandidateRunner()
    try:
        assert isinstance(runner, WatchesTimingNoise)
        assert not isinstance(LocalRunner(), WatchesTimingNoise)
    finally:
        runner.close()
