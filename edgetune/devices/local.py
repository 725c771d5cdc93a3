"""This machine's CPU: candidates and the model run here (runtime.py loads, runs and times them)."""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgetune.devices.base import Device


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

    def export_function(self) -> Callable | None:
        return None

    def latency_ms(self, library: Path, inputs: list[np.ndarray]) -> float:
        from edgetune.isolated import in_own_process

        return in_own_process(library, library_latency_ms, library, inputs, self.cpu_threads)


def library_latency_ms(library: Path, inputs: list[np.ndarray], cpu_threads: int | None) -> float:
    """The library's median latency on this machine's CPU, on `cpu_threads` threads when the profile sets them."""
    import tvm

    from edgetune.runtime import load_library, time_model, use_cpu_threads

    device = tvm.device("cpu", 0)
    if cpu_threads:
        use_cpu_threads(cpu_threads)  # as many as the reference is given
    return time_model(load_library(library, device), inputs, device)
