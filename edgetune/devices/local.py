"""This machine's CPU: candidates and the model run here (runtime.py loads, runs and times them)."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgetune.devices.base import Device

if TYPE_CHECKING:
    from edgetune.runtime import ThreadWait


class LocalDevice(Device):
    """The build machine's CPU, on the profile's cores (and as many threads as the reference gets)."""

    runs_here = True

    def __init__(self, arch: str, cores: int | None, cpu_threads: int | None) -> None:
        super().__init__(arch)
        self.cores = cores
        self.cpu_threads = cpu_threads

    @property
    def where(self) -> str:
        return f"this build machine ({platform.machine()}, {self.cores} cores)"

    def check_reachable(self, trials_per_task: int | None) -> None:
        """This machine is always there."""

    def tuning_builder_runner(self, cores: int, stop: threading.Event) -> tuple[Any, Any]:
        from edgetune.tuning.tune import local_builder_runner

        return local_builder_runner(cores, "cpu")

    def link_compiler(self) -> str | None:
        return None

    def latency_ms(self, library: Path, inputs: list[np.ndarray], min_total_s: float = 1.0) -> float:
        from edgetune.isolated import in_own_process

        return in_own_process(library, library_latency_ms, library, inputs, self.cpu_threads, None, min_total_s)

    @contextmanager
    def thread_wait_timers(self, library: Path, inputs: list[np.ndarray], ways: Sequence[ThreadWait],
                           pool: Path | None = None) -> Iterator[dict[str, Callable[[], float]] | None]:
        """A fresh process for each of `ways`, its TVM threads spinning or sleeping while they wait (TVM reads how
        once, when a process's pool starts); each loads the library once and times it per call."""
        from edgetune.isolated import processes_with
        from edgetune.runtime import SPIN_COUNT_ENV, SPIN_DOWN_S, spin_count

        if not self.cpu_threads:
            yield None
            return
        counts = [spin_count(way) for way in ways]
        with processes_with([{SPIN_COUNT_ENV: None if n is None else str(n)} for n in counts]) as processes:
            for process in processes:
                process.submit(_import_tvm)  # they all start now, while the caller goes on (a compile, say)

            def timer(process, way: ThreadWait) -> Callable[[], float]:
                def timed() -> float:
                    in_pool = pool if way == "pool" else None
                    latency = process.submit(library_latency_ms, library, inputs, self.cpu_threads, in_pool).result()
                    time.sleep(SPIN_DOWN_S)  # its threads stop spinning before the next timing
                    return latency
                return timed

            yield {way: timer(process, way) for way, process in zip(ways, processes, strict=True)}


def _import_tvm() -> None:
    import tvm  # noqa: F401


_LOADED: dict[tuple[str, int, int], Any] = {}
"""Libraries this process loaded, by path, modification time and size."""


def library_latency_ms(library: Path, inputs: list[np.ndarray], cpu_threads: int | None,
                       pool: Path | None = None, min_total_s: float = 1.0) -> float:
    """The library's median latency on this machine's CPU, on `cpu_threads` threads when the profile sets them,
    its parallel loops in edgetune's thread pool `pool` where given (thread_pool.py). A library is loaded once
    per process (TVM never unloads one): timed again, the loaded one runs."""
    import tvm

    from edgetune.runtime import load_library, time_model, use_cpu_threads

    device = tvm.device("cpu", 0)
    if cpu_threads:
        use_cpu_threads(cpu_threads)  # as many as the reference is given
    facts = library.stat()
    key = (str(library.resolve()), facts.st_mtime_ns, facts.st_size)  # a rewritten library is loaded anew
    if key not in _LOADED:
        _LOADED[key] = load_library(library, device, pool, cpu_threads or os.cpu_count() or 1)
    return time_model(_LOADED[key], inputs, device, min_total_s)
