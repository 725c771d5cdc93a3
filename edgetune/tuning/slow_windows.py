"""A reference kernel timed beside every candidate: which timings ran while the whole machine was slow.

The mean-over-median check (measurements.TimingNoise) catches a timing of which a run or two lost the CPU.
A timing slowed evenly over all its runs passes it: a neighbour holding both cores, or a vCPU losing time to
the host, slows every run alike. A 60-minute ResNet-18 build timed its input transpose at 1587 us (22 us in
other builds) while another program ended beside it; the task has one schedule, so nothing timed it again,
and its curve carried 2 ms that the model does not spend. A small parallel kernel of fixed work, timed
before each candidate on the same threads, shows such windows: a 128x128 matmul ran 80 us on this VM's
two idle cores, 160 us beside one busy loop and 3200-4500 us beside two.

A candidate timed while the reference ran more than SLOW_WINDOW times its usual reading is timed again once
the batch is timed and the machine reads quiet, and keeps the lower of its two means (slowing only adds time).
Every such candidate, not only those whose time scaled by the window's slowdown comes near their task's best:
a window adds a wait at each parallel loop's end, it does not multiply the time. Beside two busy loops a
35 us kernel ran 3200 us (90x) where the reference ran 50x slower, and a rule that scaled it down dismissed
it against its own quiet 35 us. Timed again quiet, a candidate takes no longer than it did in the window, so
the retiming at most doubles a batch's timing (3% of the candidate pipeline: builds are the rest).
"""

from __future__ import annotations

import bisect
import os
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tvm.s_tir.meta_schedule.runner import RunnerInput, RunnerResult

from edgetune.runtime import off_the_pool_threads_cores, use_cpu_threads
from edgetune.tuning.measurements import FAILED, NoiseCounts, TimingNoise, mean_seconds

if TYPE_CHECKING:
    from tvm import IRModule

SLOW_WINDOW = 1.5
"""A reference reading this many times the usual one (SlowWindows.usual_s) marks the candidate timed beside it as
timed in a slow window. Of 5594 readings over two idle minutes on a Zen 5 VM (2 threads), 9% came above 1.2x the
fastest (in spells of up to 2 s) and 0.6% above 1.5x; one busy loop beside a 2-thread timing doubles a reading,
two make it 40-55x. At 1.2x an idle 5-minute ResNet-18 build counted 93 of its 595 timings in slow windows."""
KEPT_READINGS = 4096
"""The recent readings the usual one is the median of: about the last 15 minutes of a build's timings."""

_REFERENCE_SIZE = 128
"""The reference matmul's side: 4 MFLOP, about 80 us on two Zen 5 cores (warm), short enough that a wait for a
descheduled thread at the parallel loop's end shows in full."""

_READING_RUNS = (3, 3)
"""(number, repeat) of a reading: the median of three means of three runs, about 1 ms."""

_loaded: dict[str, tuple] = {}
"""In a worker: the reference module and its arguments, by path (loaded once per worker)."""


def reference_module(n: int = _REFERENCE_SIZE) -> IRModule:
    """The reference kernel: an n x n matmul, its rows split over the threads, its columns in vectors of 16."""
    from tvm import te
    from tvm.s_tir import Schedule

    a, b = te.placeholder((n, n), name="a"), te.placeholder((n, n), name="b")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    schedule = Schedule(te.create_prim_func([a, b, c]))
    i, j, k = schedule.get_loops(schedule.get_sblock("c"))
    schedule.reorder(i, k, j)
    schedule.parallel(i)
    schedule.vectorize(schedule.split(j, [None, 16])[1])
    return schedule.mod


def build_reference_kernel(directory: str) -> str:
    """Build the reference kernel for this machine into `directory` (runs in a worker); returns the library."""
    import tvm
    from tvm.driver import build as tvm_build

    path = os.path.join(directory, "reference.so")
    tvm_build(reference_module(), target=tvm.target.Target("llvm")).export_library(path)
    return path


def time_reference(path: str, cpu_threads: int, on_threads: int) -> float:
    """On a worker: the reference's median run time in seconds, on `on_threads` of the target's `cpu_threads`,
    with the calling thread placed as a candidate's timing places it (local_runner.time_candidate)."""
    import numpy as np
    import tvm

    if path not in _loaded:
        device = tvm.cpu(0)
        arrays = [tvm.runtime.tensor(np.ones((_REFERENCE_SIZE, _REFERENCE_SIZE), "float32"), device)
                  for _ in range(3)]
        module = tvm.runtime.load_module(path)
        number, repeat = _READING_RUNS
        _loaded[path] = (module.time_evaluator(module.entry_name, device, number=number, repeat=repeat), arrays)
    evaluator, arrays = _loaded[path]
    use_cpu_threads(cpu_threads, running=on_threads)
    with off_the_pool_threads_cores():
        return statistics.median(evaluator(*arrays).results)


@dataclass
class Timed:
    """One candidate of a batch as timed: its run times (None: it failed, `error`), the reference's readings
    just before and just after it (seconds, scaled to the target's threads as the timing is) and its task's
    counts of noisy timings (`counts`)."""

    seconds: list[float] | None
    error: str | None = None
    reading_before: float = 0.0
    reading_after: float = 0.0
    counts: NoiseCounts = field(default_factory=NoiseCounts)

    @property
    def mean_s(self) -> float:
        return mean_seconds(self.seconds) if self.seconds is not None else FAILED


@dataclass
class SlowWindows:
    """The usual reference reading (the median of the recent ones) and which of a batch's timings to take again
    because of it.

    The median, not the fastest: on a Zen 3 VM the idle readings spread from 103 to 224 us (median 157 us, of
    9585 over 20 seconds), half of them above 1.5x the fastest, and an idle 10-minute MobileNet-V2 build counted
    609 of its 1092 timings in slow windows (and told its user the device had run slow for them)."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT_READINGS))
    _sorted: list[float] = field(default_factory=list)  # `recent`, in order

    def note(self, reading_s: float) -> float:
        """A reading taken: it joins the recent ones (the oldest leaves past KEPT_READINGS); returns it."""
        if len(self.recent) == self.recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.recent[0])]
        self.recent.append(reading_s)
        bisect.insort(self._sorted, reading_s)
        return reading_s

    @property
    def usual_s(self) -> float | None:
        """The recent readings' median (the lower one of an even count); None before any."""
        return self._sorted[(len(self._sorted) - 1) // 2] if self._sorted else None

    def slowdown(self, reading_s: float) -> float:
        """How many times the usual reading a reading took (1.0 before any)."""
        usual = self.usual_s
        return reading_s / usual if usual else 1.0

    def in_slow_window(self, timed: Timed) -> bool:
        return self.slowdown(max(timed.reading_before, timed.reading_after)) > SLOW_WINDOW

    def to_time_again(self, batch: Sequence[Timed]) -> list[int]:
        """Positions of the batch's timings taken in a slow window, but for failed ones."""
        return [i for i, timed in enumerate(batch) if timed.seconds is not None and self.in_slow_window(timed)]

    def retime(self, batch: list[Timed], time_again: Callable[[int], Timed], quiet_now: bool) -> None:
        """Times again, in place, the batch's timings taken in a slow window, if the machine is quiet now
        (`quiet_now`); each keeps the lower mean of its two timings. Counted into each task's counts."""
        for i in self.to_time_again(batch):
            first = batch[i]
            first.counts.slow_window += 1
            if not quiet_now:
                first.counts.slow_window_still += 1
                continue
            again = time_again(i)
            first.counts.slow_window_retimed += 1
            first.counts.slow_window_still += self.in_slow_window(again)
            if again.seconds is not None and again.mean_s < first.mean_s:
                batch[i] = again


@runtime_checkable
class TimesInWindows(Protocol):
    """A runner that times a batch beside the reference kernel (the local runner): the first batch hands it
    every task's first candidates at once, so a slow window found later in the batch still reaches them."""

    noise: TimingNoise

    def time_results(self, runner_inputs: list[RunnerInput],
                     before_each: Callable[[int], None] | None = None) -> list[RunnerResult]:
        """The batch's results in order; `before_each(i)` runs before the i-th is timed (the first batch
        watches each candidate's own task's noise there)."""
        ...
