"""The builder's and runner's worker processes: long-lived, and without PyTorch.

MetaSchedule's LocalBuilder starts fresh workers for every batch, and each imports TVM, which imports
PyTorch whenever it is installed: about 3 s and 400 MB per worker, on every batch. These workers are
TVM's own (same protocol, same timeouts), started as `python -m edgetune.isolated`, which keeps PyTorch
out (1 s, 190 MB), and reused for `_USES_PER_WORKER` jobs before being replaced (TVM restarts its
builders because long-lived ones grow). On this machine the builder and the runner share one pool: they
never work at the same time, and each worker holds at least TVM's 190 MB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from tvm.support.popen_pool import PopenPoolExecutor, PopenWorker

_USES_PER_WORKER = 256
"""Jobs a worker runs before it is replaced: bounds what a worker can leak (each candidate it timed stays loaded),
and costs one start (0.8 s) in 256. 320 candidates of a ResNet-18 build, built and timed in batches of 16 on two
workers (benchmarks/candidate_pipeline.py): 67.9 and 71.2 s with 256 jobs a worker, 73.8 and 74.7 s with 64; the
workers peaked at 316-325 MB against 308-311 MB."""


class TorchFreeWorker(PopenWorker):
    """TVM's PopenWorker, started through edgetune.isolated instead of tvm.exec.popen_worker."""

    def _start(self) -> None:
        if self._proc is not None:
            return
        main_read, worker_write = os.pipe()
        worker_read, main_write = os.pipe()
        command = [sys.executable, "-m", "edgetune.isolated", str(worker_read), str(worker_write)]
        self._proc = subprocess.Popen(command, pass_fds=(worker_read, worker_write), stdout=self._stdout,
                                      stderr=self._stderr)
        os.close(worker_read)
        os.close(worker_write)
        self._reader = os.fdopen(main_read, "rb")
        self._writer = os.fdopen(main_write, "wb")


def _nothing() -> None:
    """The job that starts a worker (`WorkerPool.start_workers`)."""


def ignore_interrupts() -> None:
    """Workers share the terminal's process group: Ctrl-C is for the main process, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Job:
    """A job of the pool that can be cut short: which worker runs it, since when, and for how long it ran."""

    def __init__(self) -> None:
        self.future: Future | None = None
        self.cut_short = False
        self._lock = threading.Lock()
        self._worker: PopenWorker | None = None
        self._started: float | None = None
        self._ended: float | None = None

    def seconds(self) -> float:
        """Seconds it has run on its worker (0 while it waits for one), or ran once it ended."""
        with self._lock:
            if self._started is None:
                return 0.0
            return (self._ended or time.monotonic()) - self._started

    def cut(self) -> bool:
        """Kills the worker process running this job; its future then raises. False if it is not running."""
        with self._lock:
            running = self._worker is not None and self._ended is None
            process = self._worker._proc if running else None
            if process is None:
                return False
            self.cut_short = True
            process.kill()
            return True

    def mark_started(self, worker: PopenWorker) -> None:
        with self._lock:
            self._worker, self._started = worker, time.monotonic()

    def mark_ended(self) -> None:
        """Marks it ended; a worker killed by `cut` after its answer came is cleaned up for a fresh start."""
        with self._lock:
            self._ended = time.monotonic()
            if self.cut_short and self._worker is not None:
                self._worker.kill()


class WorkerPool(PopenPoolExecutor):
    """TVM's PopenPoolExecutor over TorchFreeWorker processes, each reused for `uses_per_worker` jobs.

    `timeout`: seconds a job may take before its worker is killed (and replaced at the next job).
    `uses_per_worker`: jobs a worker runs before it is replaced (benchmarks/candidate_pipeline.py compares).
    """

    def __init__(self, max_workers: int, timeout: float | None, stderr: int | None = None,
                 uses_per_worker: int = _USES_PER_WORKER) -> None:
        super().__init__(max_workers=max_workers, timeout=timeout, initializer=ignore_interrupts,
                         maximum_process_uses=uses_per_worker, stderr=stderr)
        self._running: set[Job] = set()
        self._worker_count = max_workers  # beside the base class's _worker_map (the workers themselves)

    def submit_with_timeout(self, timeout: float | None, fn, *args) -> Future:
        """`fn(*args)` on a worker, killed after `timeout` seconds (None: never)."""
        return self.submit_job(timeout, fn, *args).future

    def submit_job(self, timeout: float | None, fn, *args) -> Job:
        """`fn(*args)` on a worker, killed after `timeout` seconds or when the caller cuts it short."""
        job = Job()
        job.future = self._threadpool.submit(self._run_on_worker, fn, args, {}, timeout, job)
        return job

    def start_workers(self) -> None:
        """Starts every worker now, without waiting for them: a worker's start imports TVM (1.1-1.9 s on two busy
        cores), which the caller's own work meanwhile hides. Each pool thread starts its worker with a job that
        does nothing; the jobs that follow run on those workers."""
        for _ in range(self._worker_count):  # the thread pool adds a thread per job while none is idle
            self.submit_job(None, _nothing)

    def _worker_run(self, fn, args, kwargs):
        """PopenPoolExecutor's own entry point (submit, map), with the pool's timeout."""
        return self._run_on_worker(fn, args, kwargs, self._timeout, Job())

    def _run_on_worker(self, fn, args, kwargs, timeout: float | None, job: Job):
        """PopenPoolExecutor's own, with the worker class replaced: one worker per pool thread."""
        with self._lock:
            thread = threading.get_ident()
            if thread not in self._worker_map:
                self._worker_map[thread] = TorchFreeWorker(self._initializer, self._initargs,
                                                           self._maximum_process_uses, self._stdout,
                                                           self._stderr)
            worker = self._worker_map[thread]
        worker.send(fn, args, kwargs, timeout)
        job.mark_started(worker)
        with self._lock:
            self._running.add(job)
        try:
            return worker.recv()
        finally:
            job.mark_ended()
            with self._lock:
                self._running.discard(job)

    def cut_running(self) -> int:
        """Kills the workers of every job running now (their futures raise); how many were cut."""
        with self._lock:
            running = list(self._running)
        return sum(job.cut() for job in running)

    def shutdown(self, wait: bool = True) -> None:
        """Ends the workers; a pool shared by a builder and a runner is shut down by whichever closes first."""
        if not self._shutdown:
            super().shutdown(wait=wait)
