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
from concurrent.futures import Future
from tvm.support.popen_pool import PopenPoolExecutor, PopenWorker

_USES_PER_WORKER = 64
"""Jobs a worker runs before it is replaced: bounds what a worker can leak, and costs one start in 64."""


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


def ignore_interrupts() -> None:
    """Workers share the terminal's process group: Ctrl-C is for the main process, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkerPool(PopenPoolExecutor):
    """TVM's PopenPoolExecutor over TorchFreeWorker processes, each reused for `_USES_PER_WORKER` jobs.

    `timeout`: seconds a job may take before its worker is killed (and replaced at the next job).
    """

    def __init__(self, max_workers: int, timeout: float | None, stderr: int | None = None) -> None:
        super().__init__(max_workers=max_workers, timeout=timeout, initializer=ignore_interrupts,
                         maximum_process_uses=_USES_PER_WORKER, stderr=stderr)

    def submit_with_timeout(self, timeout: float | None, fn, *args) -> Future:
        """`fn(*args)` on a worker, killed after `timeout` seconds (None: never)."""
        return self._threadpool.submit(self._run_on_worker, fn, args, {}, timeout)

    def _worker_run(self, fn, args, kwargs):
        """PopenPoolExecutor's own entry point (submit, map), with the pool's timeout."""
        return self._run_on_worker(fn, args, kwargs, self._timeout)

    def _run_on_worker(self, fn, args, kwargs, timeout: float | None):
        """PopenPoolExecutor's own, with the worker class replaced: one worker per pool thread."""
        with self._lock:
            thread = threading.get_ident()
            if thread not in self._worker_map:
                self._worker_map[thread] = TorchFreeWorker(self._initializer, self._initargs,
                                                           self._maximum_process_uses, self._stdout,
                                                           self._stderr)
            worker = self._worker_map[thread]
        worker.send(fn, args, kwargs, timeout)
        return worker.recv()

    def shutdown(self, wait: bool = True) -> None:
        """Ends the workers; a pool shared by a builder and a runner is shut down by whichever closes first."""
        if not self._shutdown:
            super().shutdown(wait=wait)
