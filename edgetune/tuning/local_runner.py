"""Measuring candidates on this machine: MetaSchedule's LocalRunner on a worker that never imports PyTorch.

The same timing function as TVM's LocalRunner, one candidate at a time on one long-lived worker
(tuning/worker_pool.py), so the candidates never run side by side and the worker costs 190 MB, not 400.
Given the builder's pool, it times on one of the builder's workers: no process of its own. A timing
near the task's best that something else on the machine disturbed is taken again (measurements.TimingNoise).
A batch is timed on as many of the target's threads as other programs left cores free (machine_load.py).
"""

from __future__ import annotations

import subprocess

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerFuture, RunnerInput
from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture, _worker_func

from edgetune.machine_load import OtherLoad
from edgetune.runtime import off_the_pool_threads_cores, use_cpu_threads
from edgetune.tuning.measurements import TimingNoise
from edgetune.tuning.worker_pool import WorkerPool


@derived_object
class LocalCandidateRunner(PyRunner):
    """Times each candidate in turn; one that runs past `timeout_sec` is killed and recorded as an error.

    `pool`: workers shared with the builder (default: one worker of its own). `noise`: which disturbed
    timings are measured again, and how many were. `cpu_threads`: the threads a CPU kernel runs on, fewer
    while other programs hold cores (None: the workers' own; GPU kernels). A timing on fewer threads is scaled
    to the target's as if the kernel's loops split evenly: the store ranks every timing of a task together, and
    an unscaled one-thread time would put a candidate measured while the machine was busy behind every one
    measured idle. The scaling flatters a candidate a little (ResNet-50's convolutions ran 1.8-1.9x, not 2x,
    slower on one thread of two), and a kernel that splits badly more.
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

    def run(self, runner_inputs: list[RunnerInput]) -> list[RunnerFuture]:
        threads = self.load.free_threads(self.cpu_threads) if self.cpu_threads else None
        if threads is not None and threads < self.cpu_threads:
            self.noise.counts.on_fewer_threads += len(runner_inputs)
        return [self._measure(runner_input, threads) for runner_input in runner_inputs]

    def _measure(self, runner_input: RunnerInput, threads: int | None) -> RunnerFuture:
        arguments = tuple(info.as_json() for info in runner_input.args_info)
        share = threads / self.cpu_threads if threads is not None else 1.0  # scales a timing to the target's threads

        def timed() -> list[float]:
            seconds = self.pool.submit_with_timeout(self.timeout_sec, time_candidate, self.timing,
                                                    str(runner_input.artifact_path), str(runner_input.device_type),
                                                    arguments, self.cpu_threads, threads).result()
            return [s * share for s in seconds]
        try:
            return LocalRunnerFuture(res=self.noise.quietest(timed(), timed), error_message=None)
        except TimeoutError:
            return LocalRunnerFuture(res=None, error_message=f"LocalRunner: Timeout, killed after "
                                                             f"{self.timeout_sec} seconds\n")
        except Exception as exc:  # the candidate's own failure, reported as TVM's runner reports it
            return LocalRunnerFuture(res=None, error_message=f"LocalRunner: An exception occurred\n{exc}")

    def close(self) -> None:
        self.pool.shutdown()


def time_candidate(timing: EvaluatorConfig, artifact_path: str, device_type: str, arguments: tuple,
                   cpu_threads: int | None = None, on_threads: int | None = None) -> list[float]:
    """On a worker: TVM's LocalRunner timing of one candidate, on `on_threads` of the target's `cpu_threads`
    (None: as the worker's pool started), with the worker's calling thread kept off its pool threads' cores (a
    fresh worker's first timings ran at twice the time otherwise)."""
    if cpu_threads is not None:
        use_cpu_threads(cpu_threads, running=on_threads)
    with off_the_pool_threads_cores():
        return _worker_func(None, None, None, timing, 1, artifact_path, device_type, arguments)
