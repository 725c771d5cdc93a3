"""The task scheduler: which of a target's tasks is tuned next, and for how many trials.

Each task gets `trials_per_task` measurements in total across builds. Without a time budget every
task is tuned to that in one pass. Under a budget, after a short first pass over every task (shorter
still for the lighter tasks where it would not fit in 40% of the budget: every task gets a measured
schedule; a task with sibling devices' schedules measures just those in it, so the whole model reaches
the siblings' quality first; those a cut first round left out open the task's next round; tasks without a
schedule go first, so after the first batch (`first_batch`) the few it gave none are next), each round
goes to the task expected to save the model the most latency per second of tuning (Ansor's task
scheduler, its gradient rule), so the budget is spent where the model spends its time; a task that stopped
improving waits until no improving task is left. A round of one task is measured by the caller
(`tune.py`: one `tune_tasks` call); the scheduler keeps each task's pace and gains.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgetune.tuning.measurements import NoiseCounts
from edgetune.tuning.search_strategy.draft_verify import SearchCounts

MAX_TRIALS_PER_ROUND = 64  # MetaSchedule's default num_trials_per_iter
_FIRST_PASS_TRIALS = 8
_SHORT_FIRST_TRIALS = 2
_FIRST_PASS_SHARE = 0.4
"""Under a budget, a first pass that would not end within this share of it, at its pace per trial so far,
gives each of the remaining tasks the trials that fit (at least _SHORT_FIRST_TRIALS): a task left without
any measured schedule compiles as a naive loop nest on one core (a ResNet-50's 11 such kernels took 1.5 s
of its 1.57 s), and the analyzer's first drafts are most of what a first round finds."""
_OBSERVED_SHARE = 0.2  # Ansor's alpha: the last round's observed gain against the optimistic estimate
_MIN_GAIN = 0.01  # a round that lowers a task's best by less is within this machine's timing noise


def _round_done_at(trials: int) -> int:
    """Under a budget a round is done at 7/8 of its trials: MetaSchedule's search now and then returns a
    candidate or two fewer than asked, and a second iteration for those would evolve a whole population
    again (a minute on a Winograd convolution)."""
    return trials - trials // 8


# two full rounds: in our builds' logs tasks often gained again after one round without a gain, never after two
_STALL_TRIALS = 2 * _round_done_at(MAX_TRIALS_PER_ROUND)


@dataclass
class TaskOutcome:
    name: str
    weight: int
    flops: float
    trials_before: int  # records the store held when this build started
    trials_measured: int  # measured by this build
    best_us: float | None
    skipped_for_budget: bool = False
    space_exhausted: bool = False  # the search ran out of schedules it had not measured
    tuning_s: float = 0.0  # spent tuning this task in this build, all rounds
    last_round_s: float = 0.0  # how long its latest round took
    last_round_gain_us: float = 0.0  # how much its latest round lowered its best latency
    trials_since_gain: int = 0  # measured in this build since a round last lowered its best by 1%
    search: SearchCounts = field(default_factory=SearchCounts)  # draft-verify's candidates per stage
    tuning_failed: str | None = None  # "<ExcType>: <message>" of the exception that ended its tuning
    timings: NoiseCounts = field(default_factory=NoiseCounts)  # its timings other work disturbed (TimingNoise)
    builds_cut: int = 0  # candidates whose build ran far longer than their batch's, killed (builder.cut_stragglers)
    sibling_seeds: int = 0  # siblings' schedules measured first (the first in one batch for all tasks, the rest
    # in the task's first round: under a budget, all of that round)

    @property
    def gflops(self) -> float | None:
        return self.flops / self.best_us / 1e3 if self.best_us and self.best_us > 0 else None

    def finish_round(self, best_us: float | None, measured: int, seconds: float) -> None:
        """What the scheduler learns from a round: its pace, its gain, and whether the task still improves."""
        before, self.best_us, self.last_round_s = self.best_us, best_us, seconds
        if before is None or best_us is None:
            self.last_round_gain_us, self.trials_since_gain = 0.0, 0
            return
        self.last_round_gain_us = before - best_us
        self.trials_since_gain = 0 if best_us < before * (1 - _MIN_GAIN) else self.trials_since_gain + measured


RoundFn = Callable[[int, int, int, "float | None"], bool]
"""(position, trials, enough, deadline): up to `trials` more measurements of one task, no further search
iteration once `enough` were sent, nor one that would end more than half past `deadline` (a
`time.monotonic()` instant, None without a budget); returns whether the deadline ended the round. A failure
is recorded on the task's outcome, not raised."""


@dataclass
class TaskScheduler:
    """Rounds of tuning over a target's tasks (see the module doc), each measured by `measure_round`."""

    outcomes: list[TaskOutcome]  # one per task, heaviest first
    trials_per_task: int
    time_budget_s: float | None
    started: float  # time.monotonic() when tuning of this target began: the budget counts from it
    measure_round: RoundFn
    best_us: Callable[[int], float | None]  # a task's best latency in the store now
    after_round: Callable[[], None]  # raises to stop between rounds (a stop request)
    round_trials: int = MAX_TRIALS_PER_ROUND
    """Trials of a round after the first pass (the search's `round_trials_under_budget` under a budget)."""
    budget_spent: bool = False
    """A round ended at the deadline with less of the budget left than half its next batch: no round follows."""
    curve: list[tuple[float, float]] = field(default_factory=list)
    """(seconds of tuning, milliseconds per inference of the tuned kernels: weight x best, summed) after each
    round once every task has had a round: the model's latency as the tuning lowered it, without the rest."""

    def run(self, keep_for_later: Callable[[], float] | None = None) -> float:
        """Every round until no task can take one; returns the seconds of the budget kept for later
        (`keep_for_later`, asked once: after the first pass when rounds remain, or during a first pass that
        has used half the budget, so that what is left of it is cut to fit; tasks go heaviest first, so
        what such a cut skips is the model's lightest kernels)."""
        budget_s, kept_s, asked = self.time_budget_s, 0.0, False
        if not self.curve:  # a resumed build's tasks start from their stores' bests (or the first batch's)
            self._record_curve_point()
        first_pass = self.trials_per_task if budget_s is None else min(_FIRST_PASS_TRIALS, self.trials_per_task)
        pass_started, sent = time.monotonic(), 0
        for turn, position in enumerate(self._first_pass_order()):
            outcome = self.outcomes[position]
            trials = first_pass if budget_s is None else min(first_pass, outcome.sibling_seeds or first_pass)
            if budget_s is not None and sent:
                trials = self._first_trials_that_fit(trials, time.monotonic() - pass_started, sent,
                                                     len(self.outcomes) - turn, budget_s)
            wanted = trials - outcome.trials_before - outcome.trials_measured  # the first batch measured some
            if wanted <= 0:
                continue
            if (budget_s is not None and keep_for_later is not None and not asked
                    and time.monotonic() - self.started > budget_s / 2):
                kept_s, asked = keep_for_later(), True
                budget_s -= kept_s
            self._round(position, wanted, budget_s)
            sent += wanted
        if budget_s is None:
            return kept_s
        if keep_for_later is not None and not asked and next_round(self.outcomes, self.trials_per_task) is not None:
            kept_s = keep_for_later()
            budget_s -= kept_s
        while (position := next_round(self.outcomes, self.trials_per_task)) is not None:
            outcome = self.outcomes[position]  # once the budget is spent, each is marked skipped in turn
            self._round(position, min(self.round_trials, self.trials_per_task - outcome.trials_before
                                      - outcome.trials_measured), budget_s)
        return kept_s

    def _first_pass_order(self) -> list[int]:
        """Tasks without a schedule first (heaviest first), then the others: once the first batch gave most
        tasks one, the model has a schedule for every kernel (its curve starts) after the few without."""
        return sorted(range(len(self.outcomes)), key=lambda p: (self.outcomes[p].best_us is not None, p))

    @staticmethod
    def _first_trials_that_fit(first_pass: int, spent_s: float, sent: int, tasks_left: int, budget_s: float) -> int:
        """A first round's trials for each task left, so the first pass ends within _FIRST_PASS_SHARE of the
        budget at its pace per trial so far (which counts each round's fixed cost: fewer trials, dearer ones)."""
        if spent_s <= 0:  # rounds too quick for the clock: they all fit
            return first_pass
        left_s = _FIRST_PASS_SHARE * budget_s - spent_s
        fit = int(left_s / (spent_s / sent * tasks_left)) if left_s > 0 else 0
        return max(min(_SHORT_FIRST_TRIALS, first_pass), min(first_pass, fit))

    def _round(self, position: int, trials: int, budget_s: float | None) -> None:
        """Up to `trials` more measurements of one task, cut to what fits in the budget."""
        outcome = self.outcomes[position]
        deadline = self.started + budget_s if budget_s is not None else None
        if deadline is not None:
            trials = 0 if self.budget_spent else trials_that_fit(trials, outcome, deadline - time.monotonic())
            if trials <= 0:
                outcome.skipped_for_budget = True
                return
        enough = trials if self.time_budget_s is None else _round_done_at(trials)
        measured_before, round_started = outcome.trials_measured, time.monotonic()
        try:
            cut = self.measure_round(position, trials, enough, deadline)
        finally:
            outcome.tuning_s += time.monotonic() - round_started
        # MetaSchedule ends a task early only when its search has no new candidate (or the deadline came):
        # another round would evolve a population to find none again
        round_measured = outcome.trials_measured - measured_before
        if cut:
            outcome.skipped_for_budget = self.budget_spent = True
        outcome.space_exhausted = not cut and outcome.tuning_failed is None and round_measured < enough
        outcome.finish_round(self.best_us(position), round_measured, time.monotonic() - round_started)
        self._record_curve_point()
        self.after_round()

    def _record_curve_point(self) -> None:
        point = curve_point(self.outcomes, self.started)
        if point is not None:
            self.curve.append(point)


def curve_point(outcomes: list[TaskOutcome], started: float) -> tuple[float, float] | None:
    """(seconds since `started`, the tasks' summed kernel milliseconds) once every task has a best or has had
    its first round, else None: a task whose candidates all failed (a `take` fed random indices) has no time
    of its own, and its kernel joins the model's rest."""
    if not all(o.best_us is not None or o.tuning_s > 0 for o in outcomes):
        return None
    kernels_ms = sum(o.weight * o.best_us for o in outcomes if o.best_us is not None) / 1e3
    return time.monotonic() - started, kernels_ms


def trials_that_fit(trials: int, outcome: TaskOutcome, left_s: float) -> int:
    """How many of `trials` fit in what is left of the budget, at the pace this task was tuned at
    earlier in this build (a round of 64 Winograd trials takes minutes here: started with a minute
    left, it would overrun the budget by the rest)."""
    if left_s <= 0:
        return 0
    if outcome.trials_measured == 0 or outcome.tuning_s <= 0:
        return trials
    return min(trials, int(left_s * outcome.trials_measured / outcome.tuning_s))


def next_round(outcomes: list[TaskOutcome], trials_per_task: int) -> int | None:
    """Position of the task whose next round is expected to save the model the most latency per second
    of tuning; None when no task can take one (all tuned, out of schedules, or cut by the budget).

    Tasks not tuned yet in this build come first, in their order (heaviest first). A task without a
    gain in its last two rounds waits until no other can take one (Ansor stops such a task; here it
    may still have the budget's end)."""
    open_positions = [p for p, o in enumerate(outcomes) if _wants_trials(o, trials_per_task)]
    if not open_positions:
        return None
    improving = [p for p in open_positions if outcomes[p].trials_since_gain < _STALL_TRIALS]
    return max(improving or open_positions, key=lambda p: (gain_rate(outcomes[p]), -p))


def gain_rate(outcome: TaskOutcome) -> float:
    """Seconds of model latency that a second more of tuning this task is expected to save.

    Ansor's task-scheduler gradient, per second of tuning instead of per round (a Winograd
    convolution's round costs three times a 1x1 convolution's): weight (calls per inference) times
    a mix of the latency its last round saved per second and the optimistic best / time tuned so far,
    which assumes it can improve as much again as it has. A task's share of the budget so tends to its
    share of the model's time, and grows while it keeps improving."""
    if outcome.best_us is None or outcome.tuning_s <= 0:
        return math.inf
    observed = outcome.last_round_gain_us / outcome.last_round_s if outcome.last_round_s > 0 else 0.0
    optimistic = outcome.best_us / outcome.tuning_s
    return outcome.weight * (_OBSERVED_SHARE * observed + (1 - _OBSERVED_SHARE) * optimistic) * 1e-6


def _wants_trials(outcome: TaskOutcome, trials_per_task: int) -> bool:
    return (not outcome.space_exhausted and not outcome.skipped_for_budget and outcome.tuning_failed is None
            and outcome.trials_before + outcome.trials_measured < trials_per_task)
