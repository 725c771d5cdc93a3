"""The task scheduler under a time budget: what it keeps for the stages after tuning is kept in time."""

from __future__ import annotations

import types

import pytest

from edgetune.tuning import task_scheduler
from edgetune.tuning.task_scheduler import TaskOutcome, TaskScheduler

_ROUND_S = 0.3


class _Clock:
    """The scheduler's clock, advanced by the rounds alone: with the real one, a round woken 10 ms late on a
    busy machine changed a task's pace and so the rounds these tests count (found by reading, not seen failing)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    """Every test here on the fake clock (the module's `time` replaced, not the process's)."""
    fake = _Clock()
    monkeypatch.setattr(task_scheduler, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


def _run(clock: _Clock, tasks: int, budget_s: float, kept_s: float, trials_per_task: int = 8
         ) -> tuple[list[TaskOutcome], list[int], float]:
    """Rounds that each take _ROUND_S; returns the outcomes, the rounds done when the reserve was asked for,
    and the seconds from the start to the end of the last round."""
    outcomes = [TaskOutcome(f"task{i}", 1, 1e6, 0, 0, None) for i in range(tasks)]
    rounds_done: list[int] = []
    asked_after: list[int] = []

    def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> None:
        clock.sleep(_ROUND_S)
        outcomes[position].trials_measured += trials
        rounds_done.append(position)

    def keep_for_later() -> float:
        asked_after.append(len(rounds_done))
        return kept_s

    started = clock.monotonic()
    scheduler = TaskScheduler(outcomes, trials_per_task, budget_s, started, measure_round, lambda p: 10.0, lambda: None)
    assert scheduler.run(keep_for_later) == kept_s
    return outcomes, asked_after, clock.monotonic() - started


def test_a_first_pass_past_half_the_budget_keeps_the_reserve_at_once_and_cuts_the_rest(clock: _Clock) -> None:
    """Without this, a slow first pass (a busy machine) ran to the budget's end, then kept the reserve on top."""
    budget_s, kept_s = 1.0, 0.3
    outcomes, asked_after, elapsed = _run(clock, 4, budget_s, kept_s)
    assert asked_after == [2]  # 0.6 s of 1.0 gone after two rounds
    assert outcomes[3].skipped_for_budget and outcomes[3].trials_measured == 0  # the lightest task
    assert elapsed + kept_s <= budget_s + _ROUND_S  # a round started in time may end a little past


def test_a_quick_first_pass_keeps_the_reserve_after_it(clock: _Clock) -> None:
    outcomes, asked_after, _ = _run(clock, 2, 100.0, 0.3, trials_per_task=16)  # rounds remain after the first pass
    assert asked_after == [2] and not any(o.skipped_for_budget for o in outcomes)
    assert all(o.trials_measured == 16 for o in outcomes)


def test_a_first_pass_that_would_not_fit_gives_the_lighter_tasks_short_rounds(clock: _Clock) -> None:
    """Every task gets a measured schedule: a task left without one ships as a naive loop nest on one core."""
    outcomes = [TaskOutcome(f"task{i}", 1, 1e6, 0, 0, None) for i in range(10)]
    first_rounds: list[tuple[int, int]] = []

    def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> None:
        clock.sleep(0.02 * trials)  # 8 trials: 0.16 s; ten of them would take 80% of the budget
        if outcomes[position].trials_measured == 0:
            first_rounds.append((position, trials))
        outcomes[position].trials_measured += trials

    scheduler = TaskScheduler(outcomes, 1000, 2.0, clock.monotonic(), measure_round, lambda p: 10.0, lambda: None)
    scheduler.run()
    assert [position for position, _ in first_rounds] == list(range(10))
    assert first_rounds[0][1] == 8 and all(2 <= trials < 8 for _, trials in first_rounds[3:])
    assert sum(trials for _, trials in first_rounds) < 50  # the first pass fit (ten rounds of 8: 80)
    assert not any(o.skipped_for_budget and o.trials_measured == 0 for o in outcomes)


def test_first_round_trials_never_exceed_the_trials_asked_for_nor_divide_by_a_zero_pace() -> None:
    fit = TaskScheduler._first_trials_that_fit
    assert fit(1, 5.0, 1, 10, 10.0) == 1  # trials_per_task 1: a late pass cannot raise it to 2
    assert fit(8, 0.0, 8, 10, 10.0) == 8  # rounds faster than the clock's resolution
    assert fit(8, 5.0, 8, 10, 10.0) == 2  # past 40% of the budget already: the least


def test_under_a_budget_a_task_with_sibling_schedules_measures_just_those_first(clock: _Clock) -> None:
    """The whole model reaches its siblings' quality before any task is searched (the time to beat a reference
    is then the seeds' time); a task without seeds gets the usual first round, and without a budget the
    seeds are part of the task's one pass."""
    def first_rounds(budget_s: float | None) -> list[int]:
        outcomes = [TaskOutcome("seeded", 1, 1e6, 0, 0, None, sibling_seeds=3),
                    TaskOutcome("unseeded", 1, 1e6, 0, 0, None)]
        trials_of_first: list[int] = []

        def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> None:
            if outcomes[position].trials_measured == 0:
                trials_of_first.append(trials)
            outcomes[position].trials_measured += trials

        TaskScheduler(outcomes, 16, budget_s, clock.monotonic(), measure_round, lambda p: 10.0, lambda: None).run()
        assert all(o.trials_measured == 16 for o in outcomes)  # the seeds take no trials from the task
        return trials_of_first

    assert first_rounds(100.0) == [3, 8]
    assert first_rounds(None) == [16, 16]


def test_a_seed_the_siblings_batch_measured_is_not_asked_for_again(clock: _Clock) -> None:
    """The first batch measured one seed of each seeded task before the scheduler ran: the task's first
    round is its other seeds (under a budget) or the rest of its trials, after the first round of the task
    the batch could not seed; a curve point taken after the batch is the curve's start."""
    def first_rounds(budget_s: float | None, seeds: int) -> tuple[list[int], TaskScheduler]:
        outcomes = [TaskOutcome("seeded", 1, 1e6, 0, 1, 10.0, sibling_seeds=seeds),
                    TaskOutcome("unseeded", 1, 1e6, 0, 0, None)]
        trials_of_first: list[int] = []

        def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> None:
            if outcomes[position].trials_measured <= (position == 0):
                trials_of_first.append(trials)
            outcomes[position].trials_measured += trials

        scheduler = TaskScheduler(outcomes, 16, budget_s, clock.monotonic(), measure_round, lambda p: 10.0,
                                  lambda: None, curve=[(1.0, 0.01)])
        scheduler.run()
        assert all(o.trials_measured == 16 for o in outcomes)
        return trials_of_first, scheduler

    (budgeted, scheduler), (unbudgeted, _) = first_rounds(100.0, 4), first_rounds(None, 4)
    assert (budgeted, unbudgeted) == ([8, 3], [16, 15])  # the unseeded task first: it has no schedule yet
    assert scheduler.curve[0] == (1.0, 0.01) and len(scheduler.curve) > 1
    # its one seed was its first pass: after the unseeded task's first round come the search's rounds
    assert first_rounds(100.0, 1)[0] == [8, 15]


def test_under_a_budget_draft_verify_rounds_are_short_so_every_task_gets_another(clock: _Clock) -> None:
    """Rounds of 64 took 18-50 s in a 10-minute ResNet-50 build: 12 fitted after the first pass, for 28
    tasks, and tasks called three times per inference kept their first pass's schedules. Draft-verify's
    rounds are its first batches (8 + 16); the stock search keeps 64 (each round evolves a population)."""
    from edgetune.tuning.search_strategy import round_trials_under_budget
    from edgetune.tuning.task_scheduler import MAX_TRIALS_PER_ROUND

    def rounds(search: str) -> list[tuple[int, int]]:
        outcomes = [TaskOutcome(f"task{i}", 1, 1e6, 0, 0, None) for i in range(4)]
        done: list[tuple[int, int]] = []

        def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> None:
            clock.sleep(0.005 * trials)  # a round of 64: 0.32 s
            outcomes[position].trials_measured += trials
            done.append((position, trials))

        TaskScheduler(outcomes, 1000, 1.2, clock.monotonic(), measure_round, lambda p: 10.0, lambda: None,
                      round_trials=round_trials_under_budget(search, MAX_TRIALS_PER_ROUND)).run()
        return done

    draft_verify = rounds("draft-verify")
    assert [trials for _, trials in draft_verify[:4]] == [8] * 4
    assert {trials for _, trials in draft_verify[4:-1]} == {24}  # the last may be cut to what fits
    assert {position for position, _ in draft_verify[4:]} == {0, 1, 2, 3}
    assert rounds("evolutionary")[4][1] == 64


def test_a_round_the_deadline_ended_ends_the_tuning_and_is_not_taken_for_a_searched_out_task(clock: _Clock) -> None:
    """The deadline cuts a round only when less of the budget is left than half its next batch: a round of
    another task would overrun it by its first batch, and the task still has schedules to search."""
    outcomes = [TaskOutcome(f"task{i}", 1, 1e6, 0, 0, None) for i in range(3)]
    deadlines: list[float | None] = []

    def measure_round(position: int, trials: int, enough: int, deadline: float | None) -> bool:
        deadlines.append(deadline)
        outcomes[position].trials_measured += 1  # fewer than asked for: the search stopped sending
        return position == 1

    started = clock.monotonic()
    TaskScheduler(outcomes, 1000, 100.0, started, measure_round, lambda p: 10.0, lambda: None).run()
    assert len(deadlines) == 2 and all(d == started + 100.0 for d in deadlines)  # task 1's cut round is the last
    assert outcomes[1].skipped_for_budget and not outcomes[1].space_exhausted
    assert outcomes[0].space_exhausted and outcomes[2].skipped_for_budget and outcomes[2].trials_measured == 0
