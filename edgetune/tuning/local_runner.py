"""Measuring candidates on this machine: MetaSchedule's LocalRunner on a worker that never imports PyTorch.

The same timing function as TVM's LocalRunner, one candidate at a time on one long-lived worker
(tuning/worker_pool.py), so the candidates never run side by side and the worker costs 190 MB, not 400.
Given the builder's pool, it times on one of the builder's workers: no process of its own. A timing
near the task's best that something else on the machine disturbed is taken again (measurements.TimingNoise).
A batch is timed on as many of the target's threads as other programs left cores free (machine_load.py), and
a CPU candidate timed while a reference kernel beside it ran slow is timed again (slow_windows.py).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerFuture, RunnerInput, RunnerResult
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture, _worker_func

from edgetune.machine_load import OtherLoad
from edgetune.runtime import off_the_pool_threads_cores, use_cpu_threads
from edgetune.tuning.analyzer.tir import thread_share
from edgetune.tuning.builder import parallel_extent_beside
from edgetune.tuning.measurements import TimingNoise
from edgetune.tuning.slow_windows import SLOW_WINDOW, SlowWindows, Timed, build_reference_kernel, time_reference
from edgetune.tuning.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


@derived_object
class LocalCandidateRunner(PyRunner):
    """Times each candidate in turn; one that runs past `timeout_sec` is killed and recorded as an error.

    `pool`: workers shared with the builder (default: one worker of its own). `noise`: which disturbed
    timings are measured again, and how many were. `cpu_threads`: the threads a CPU kernel runs on, fewer
    while other programs hold cores (None: the workers' own; GPU kernels). A timing on fewer threads is scaled
    to the target's (`thread_share`): the store ranks every timing of a task together, and an unscaled one-thread
    time would put a candidate measured while the machine was busy behind every one measured idle. The scaling
    still flatters a candidate a little (ResNet-50's convolutions ran 1.8-1.9x, not 2x, slower on one thread of
    two).
    """

    def __init__(self, timing: EvaluatorConfig | None = None, timeout_sec: float = 30.0,
                 pool: WorkerPool | None = None, cpu_threads: int | None = None) -> None:
        super().__init__()
        self.timing = EvaluatorConfig._normalized(timing)
        self.timeout_sec = timeout_sec
        self.pool = pool or WorkerPool(1, timeout_sec, stderr=subprocess.DEVNULL)
        self.noise = TimingNoise()
        self.cpu_threads = cpu_threads
        self.load = OtherLoad()
        self.windows: SlowWindows | None = SlowWindows() if cpu_threads is not None else None
        self._reference: str | None = None  # the reference kernel's library, once built
        self._reference_dir: str | None = None

    def run(self, runner_inputs: list[RunnerInput]) -> list[RunnerFuture]:
        return [LocalRunnerFuture(res=t.seconds, error_message=t.error) for t in self._time_batch(runner_inputs)]

    def time_results(self, runner_inputs: list[RunnerInput],
                     before_each: Callable[[int], None] | None = None) -> list[RunnerResult]:
        """The batch's results in order (slow_windows.TimesInWindows); `before_each(i)` runs before the i-th."""
        return [RunnerResult(t.seconds, t.error) for t in self._time_batch(runner_inputs, before_each)]

    def _time_batch(self, runner_inputs: list[RunnerInput],
                    before_each: Callable[[int], None] | None = None) -> list[Timed]:
        """Each candidate in turn, a reference reading before and after each; then those timed in a slow window
        that may matter, again (SlowWindows.retime)."""
        threads = self.load.free_threads(self.cpu_threads) if self.cpu_threads else None
        reading = self._reading(threads)
        batch = []
        for i, runner_input in enumerate(runner_inputs):
            if before_each is not None:
                before_each(i)
            if threads is not None and threads < self.cpu_threads:
                self.noise.counts.on_fewer_threads += 1
            timed = Timed(None, reading_before=reading, counts=self.noise.counts)
            timed.seconds, timed.error = self._measure(runner_input, threads)
            reading = timed.reading_after = self._reading(threads)
            batch.append(timed)
        if self.windows is not None:
            self.windows.retime(batch, lambda i: self._again(runner_inputs[i], threads, batch[i]),
                                quiet_now=self.windows.slowdown(reading) <= SLOW_WINDOW)
        return batch

    def _measure(self, runner_input: RunnerInput, threads: int | None) -> tuple[list[float] | None, str | None]:
        """(run seconds, None), with a disturbed timing near the best taken again; or (None, the error)."""
        try:
            return self.noise.quietest(self._seconds(runner_input, threads), lambda: self._seconds(runner_input,
                                                                                                   threads)), None
        except TimeoutError:
            return None, f"LocalRunner: Timeout, killed after {self.timeout_sec} seconds\n"
        except Exception as exc:  # noqa: BLE001 (the candidate's own failure, reported as TVM's runner reports it)
            return None, f"LocalRunner: An exception occurred\n{exc}"

    def _again(self, runner_input: RunnerInput, threads: int | None, first: Timed) -> Timed:
        """A candidate timed once more, between two readings, counted into its first timing's task."""
        again = Timed(None, reading_before=self._reading(threads), counts=first.counts)
        try:
            again.seconds = self._seconds(runner_input, threads)
        except Exception as exc:  # noqa: BLE001 (it failed this time, not before: the first timing stands)
            again.error = str(exc)
        again.reading_after = self._reading(threads)
        return again

    def _seconds(self, runner_input: RunnerInput, threads: int | None) -> list[float]:
        """One timing of a candidate on `threads`, scaled to the target's threads."""
        arguments = tuple(info.as_json() for info in runner_input.args_info)
        share = 1.0 if threads in (None, self.cpu_threads) else thread_share(
            parallel_extent_beside(str(runner_input.artifact_path)), threads, self.cpu_threads)
        seconds = self.pool.submit_with_timeout(self.timeout_sec, time_candidate, self.timing,
                                                str(runner_input.artifact_path), str(runner_input.device_type),
                                                arguments, self.cpu_threads, threads).result()
        return [s * share for s in seconds]

    def _reading(self, threads: int | None) -> float:
        """The reference kernel's time on `threads`, scaled to the target's threads as a timing is; 0.0 where
        there is none (GPU kernels; the reference could not be built or timed), which no window counts."""
        if threads is None or not self._reference_ready():
            return 0.0
        try:
            seconds = self.pool.submit_with_timeout(self.timeout_sec, time_reference, self._reference,
                                                    self.cpu_threads, threads).result()
        except Exception as exc:  # noqa: BLE001 (a worker lost: candidates are timed as before, no windows)
            logger.warning("the reference kernel could not be timed (%s: %s); slow windows are no longer watched",
                           type(exc).__name__, exc)
            self.windows = None
            return 0.0
        return self.windows.note(seconds * threads / self.cpu_threads)

    def _reference_ready(self) -> bool:
        """Builds the reference kernel on first use; False where there is none."""
        if self.windows is not None and self._reference is None:
            self._reference_dir = tempfile.mkdtemp(prefix="edgetune-reference-")
            try:
                self._reference = self.pool.submit_with_timeout(self.timeout_sec, build_reference_kernel,
                                                                self._reference_dir).result()
            except Exception as exc:  # noqa: BLE001 (no compiler for it: candidates are timed as before)
                logger.warning("the reference kernel could not be built (%s: %s); slow windows are not watched",
                               type(exc).__name__, exc)
                self.windows = None
        return self.windows is not None

    def close(self) -> None:
        self.pool.shutdown()
        if self._reference_dir is not None:
            shutil.rmtree(self._reference_dir, ignore_errors=True)


def time_candidate(timing: EvaluatorConfig, artifact_path: str, device_type: str, arguments: tuple,
                   cpu_threads: int | None = None, on_threads: int | None = None) -> list[float]:
    """On a worker: TVM's LocalRunner timing of one candidate, on `on_threads` of the target's `cpu_threads`
    (None: as the worker's pool started), with the worker's calling thread kept off its pool threads' cores (a
    fresh worker's first timings ran at twice the time otherwise)."""
    if cpu_threads is not None:
        use_cpu_threads(cpu_threads, running=on_threads)
    with off_the_pool_threads_cores():
        return _worker_func(None, None, None, timing, 1, artifact_path, device_type, arguments)
