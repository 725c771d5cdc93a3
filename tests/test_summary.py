"""The build summary's tuning curve: the tuner's kernel sums anchored at the measured model latency."""

from __future__ import annotations

from edgetune.report.summary import TargetResult


def _result(curve: list[tuple[float, float]], tuned: float | None, reference: float | None) -> TargetResult:
    result = TargetResult("host", tuning_curve=curve, latency_ms=tuned, reference_latency_ms=reference)
    result.anchor_tuning_curve()
    return result


def test_the_rest_of_the_model_is_added_to_every_point_and_the_first_point_below_the_reference_is_the_time():
    result = _result([(10.0, 2.0), (20.0, 1.0), (30.0, 0.9)], tuned=1.4, reference=2.0)
    assert result.tuning_curve == [(10.0, 2.5), (20.0, 1.5), (30.0, 1.4)]
    assert result.time_to_beat_reference_s == 20.0


def test_never_below_the_reference_is_none():
    result = _result([(10.0, 2.0), (20.0, 1.0)], tuned=1.5, reference=1.0)
    assert result.time_to_beat_reference_s is None
    assert result.tuning_curve[-1] == (20.0, 1.5)


def test_without_a_measured_latency_or_a_reference_nothing_is_claimed():
    untimed = _result([(10.0, 2.0)], tuned=None, reference=3.0)
    assert untimed.tuning_curve == [] and untimed.time_to_beat_reference_s is None
    no_reference = _result([(10.0, 2.0)], tuned=2.5, reference=None)
    assert no_reference.time_to_beat_reference_s is None and no_reference.tuning_curve == [(10.0, 2.5)]


def test_a_model_faster_than_its_kernels_sum_scales_the_curve_to_end_at_its_latency():
    """Timed alone with a cold cache, kernels can sum to more than the model. A ResNet-18 build ran at 12.38 ms
    against ONNX Runtime's 12.79 ms while its curve, clamped, ended at 12.85 ms: 'never beat it'."""
    result = _result([(5.0, 3.0), (9.0, 2.0)], tuned=1.8, reference=2.5)
    assert result.tuning_curve == [(5.0, 3.0 * 0.9), (9.0, 1.8)]
    assert result.time_to_beat_reference_s == 9.0
    beaten_at_the_end = _result([(67.0, 16.34), (126.0, 16.08), (182.0, 12.85)], tuned=12.38, reference=12.79)
    assert beaten_at_the_end.tuning_curve[-1] == (182.0, 12.38) and beaten_at_the_end.time_to_beat_reference_s == 182.0


def test_the_curve_survives_the_summary_json():
    result = _result([(10.0, 2.0), (20.0, 1.0)], tuned=1.4, reference=2.0)
    again = TargetResult.model_validate(result.model_dump(mode="json"))
    assert again.tuning_curve == result.tuning_curve and again.time_to_beat_reference_s == 20.0


def _outcome(name: str, weight: int, best_us: float | None):
    from edgetune.tuning.task_scheduler import TaskOutcome

    return TaskOutcome(name, weight, 1e6, trials_before=0, trials_measured=0, best_us=best_us)


def test_the_scheduler_draws_a_point_per_round_once_every_task_had_one_and_a_failed_task_adds_nothing():
    """Two tasks, 4 trials each in one pass: the first round leaves the second untried (no point); after the
    second round, the point is the first task's weight x best, the second's candidates having all failed."""
    import time

    from edgetune.tuning.task_scheduler import TaskScheduler

    outcomes = [_outcome("conv", 2, None), _outcome("take", 1, None)]
    bests = {0: 10.0, 1: None}

    def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> None:
        outcomes[position].trials_measured += trials

    scheduler = TaskScheduler(outcomes, 4, None, time.monotonic(), measure_round, bests.get, lambda: None)
    scheduler.run()
    assert len(scheduler.curve) == 1
    assert scheduler.curve[0][1] == 2 * 10.0 / 1e3
