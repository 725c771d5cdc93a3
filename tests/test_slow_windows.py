"""Candidates timed while the whole machine ran slow: seen by a reference kernel beside them, timed again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest
import tvm
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput

from edgetune import machine_load
from edgetune.tuning.measurements import FAILED, NoiseCounts, mean_seconds
from edgetune.tuning.slow_windows import KEPT_READINGS, SlowWindows, Timed, reference_module
from edgetune.tuning.tune import local_builder_runner

QUIET, SLOW = 80e-6, 800e-6  # reference readings: as on an idle 2-core VM, and ten times that


def _timed(mean_s: float, before: float = QUIET, after: float = QUIET, counts: NoiseCounts | None = None) -> Timed:
    return Timed([mean_s] * 10, reading_before=before, reading_after=after,
                 counts=counts if counts is not None else NoiseCounts())


def _windows(*readings: float) -> SlowWindows:
    windows = SlowWindows()
    for reading in readings:
        windows.note(reading)
    return windows


def test_every_timing_beside_a_slow_reading_is_timed_again_however_far_behind_its_task_it_seems() -> None:
    windows = _windows(QUIET, SLOW)
    task = NoiseCounts()
    batch = [_timed(35e-6, counts=task), _timed(900e-6, before=SLOW, counts=task),
             _timed(3200e-6, after=SLOW, counts=task), _timed(40e-6, counts=task)]
    # 3200 us in a 10x window scales to 320 us, far behind the task's quiet 35 us; but a window adds a wait at
    # each parallel loop's end rather than multiplying the time: a 35 us kernel ran 3200 us beside two busy loops
    assert windows.to_time_again(batch) == [1, 2]


def test_a_reading_counts_against_the_quiet_readings_so_far_whenever_it_came() -> None:
    windows = _windows(SLOW)  # the machine was slow from the start: nothing to compare with yet
    batch = [_timed(1587e-6, before=SLOW, after=SLOW)]
    assert windows.to_time_again(batch) == []
    windows.note(QUIET)  # the window closed before the batch ended: its first timings were slow after all
    assert windows.to_time_again(batch) == [0]


# Reference readings (us) over 20 idle seconds on a 2-core Zen 3 VM: its percentiles 1, 10, 25, 50, 75, 90, 95, 99
# (of 9585 readings: the fastest 103 us, the median 157 us), each as many times as the readings it stands for.
# Against the fastest reading, half of them had read "slow": an idle 10-minute build counted 609 of 1092 timings.
ZEN3_IDLE_US = {103.5: 1, 114.0: 9, 137.9: 15, 157.3: 25, 163.5: 25, 171.6: 15, 209.5: 5, 223.6: 5}


def test_an_idle_machine_whose_readings_spread_reads_quiet_and_a_busy_loop_beside_it_does_not() -> None:
    windows = _windows(*(us * 1e-6 for us, count in ZEN3_IDLE_US.items() for _ in range(count)))
    batch = [_timed(500e-6, before=us * 1e-6, after=us * 1e-6) for us in ZEN3_IDLE_US]
    assert windows.to_time_again(batch) == []  # its fastest readings are the VM's lucky ones, not its quiet
    beside_a_busy_loop = 2 * 157.3e-6  # one busy loop beside a 2-thread reading doubles it
    assert windows.to_time_again([_timed(500e-6, before=beside_a_busy_loop)]) == [0]


def test_the_quiet_reading_follows_the_recent_readings_within_a_bound() -> None:
    windows = _windows(*[QUIET] * KEPT_READINGS)
    for _ in range(KEPT_READINGS):  # a machine twice as slow for good (another VM took the host's cores)
        windows.note(2 * QUIET)
    assert len(windows.recent) == KEPT_READINGS
    assert windows.slowdown(2 * QUIET) == pytest.approx(1.0)


def test_a_failed_timing_is_never_timed_again() -> None:
    windows = _windows(QUIET, SLOW)
    assert windows.to_time_again([Timed(None, "LocalRunner: Timeout", SLOW, SLOW)]) == []


def test_timed_again_the_lower_mean_stays_and_each_task_counts_its_own() -> None:
    windows = _windows(QUIET, SLOW)
    first_task, second_task = NoiseCounts(), NoiseCounts()
    batch = [_timed(1587e-6, before=SLOW, counts=first_task), _timed(400e-6, after=SLOW, counts=second_task),
             _timed(35e-6, counts=second_task)]
    again = {0: _timed(22e-6, counts=first_task), 1: _timed(450e-6, before=SLOW, counts=second_task)}
    windows.retime(batch, lambda i: again[i], quiet_now=True)
    assert [mean_seconds(t.seconds) for t in batch] == pytest.approx([22e-6, 400e-6, 35e-6])  # 450 > 400
    assert (first_task.slow_window, first_task.slow_window_retimed, first_task.slow_window_still) == (1, 1, 0)
    assert (second_task.slow_window, second_task.slow_window_retimed, second_task.slow_window_still) == (1, 1, 1)
    assert NoiseCounts.total([first_task, second_task]).slow_window == 2


def test_while_the_machine_is_still_slow_nothing_is_timed_again() -> None:
    windows = _windows(QUIET, SLOW)
    counts = NoiseCounts()
    batch = [_timed(900e-6, before=SLOW, counts=counts)]

    def never(_: int) -> Timed:
        raise AssertionError("timed again in a slow window")
    windows.retime(batch, never, quiet_now=False)
    assert (counts.slow_window, counts.slow_window_retimed, counts.slow_window_still) == (1, 0, 1)
    assert mean_seconds(batch[0].seconds) == pytest.approx(900e-6) and batch[0].mean_s < FAILED


def _wait_until_spinning(loops: list[subprocess.Popen], cpu_s: float = 0.2, deadline_s: float = 20.0) -> None:
    """Return once every busy loop has run `cpu_s` of CPU: a fixed sleep would, on a slow machine, start the
    timing before the loops' interpreters had started and leave no slow window to detect."""
    processes = [psutil.Process(loop.pid) for loop in loops]
    end = time.monotonic() + deadline_s
    while any(sum(p.cpu_times()[:2]) < cpu_s for p in processes):
        assert time.monotonic() < end, "the busy loops never ran"
        time.sleep(0.02)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: a kernel has no parallel loop to wait in")
@pytest.mark.serial  # it waits for a quiet machine, which another worker's tests would not give it
def test_a_candidate_timed_while_other_programs_held_every_core_is_timed_again_once_they_end(monkeypatch) -> None:
    """Busy loops at this process's priority, two per core, start just before the first of three timings of one
    candidate and end just after it: its two threads wait on each other at the parallel loop's end, the reference
    beside it runs many times slower, so the candidate is timed again once the machine is quiet, and its result is
    in line with its two quiet timings, although the window slowed this short kernel far more than the reference
    (a wait at each parallel loop's end: 3194 us against 34 us before every slow timing was taken again).
    Timed on every core whatever ran before (a timing on one thread barely slows beside the loops:
    machine_load.py), as a batch is when the loops start after the batch began."""
    cores = os.cpu_count() or 1
    monkeypatch.setattr(machine_load, "TAKEN_CORE", float(cores + 1))  # no core counts as taken
    mod = reference_module(96)  # about 35 us on two idle cores
    builder, runner = local_builder_runner(cores, "cpu")
    hogs: list[subprocess.Popen] = []
    path = None

    def busy_only_for_the_first(i: int) -> None:
        if i == 0:
            # two per core: with one per core, the reference's threads (woken from sleep, so run first) now and
            # then ran their whole reading before any busy loop took a core back (2 of 15 runs on a Zen 4 VM read
            # no slow window; with two per core, each of 117 read one)
            hogs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores))
            _wait_until_spinning(hogs)
        else:
            for hog in hogs:
                hog.kill()
                hog.wait()
    try:
        (built,) = builder.build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"}))])
        path = built.artifact_path
        runner_input = RunnerInput(path, "cpu", ArgInfo.from_prim_func(mod["main"]))
        runner.noise.watch(NoiseCounts(), None)
        results = runner.time_results([runner_input] * 3, before_each=busy_only_for_the_first)
        assert all(r.error_msg is None for r in results)
        counts = runner.noise.counts
        assert counts.slow_window >= 1 and counts.slow_window_retimed >= 1
        means = [mean_seconds(r.run_secs) for r in results]
        assert means[0] < 3 * min(means[1:]), means
    finally:
        for hog in hogs:
            hog.kill()
        builder.close()
        runner.close()
        if path is not None:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    assert runner._reference_dir is not None and not os.path.exists(runner._reference_dir)
