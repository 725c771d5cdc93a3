"""Device: where one target's code runs, as its stages ask it (tune, measure, verify, the summary).

The build decides once, in `open_device` (devices/__init__.py): this machine's CPU (local.py), a device
over TVM RPC (rpc.py), or none at all (none.py: compiled here, run nowhere).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgetune.fleet.endpoints import device_summary

if TYPE_CHECKING:
    from edgetune.package.manifest import Manifest
    from edgetune.package.verify import OutputCheck
    from edgetune.runtime import ThreadWait


class Device(ABC):
    """One target's device. `arch`: the toolchain's architecture, as the summary names it."""

    runs_here = False
    """Code runs in this process: kernels are compared inside the model, and the reference is timed beside."""

    def __init__(self, arch: str) -> None:
        self.arch = arch

    @property
    @abstractmethod
    def where(self) -> str | None:
        """Where measurements are made, as the manifest's `measured_on` says it; None: nowhere."""

    @property
    def can_measure(self) -> bool:
        return self.where is not None

    @abstractmethod
    def check_reachable(self, trials_per_task: int | None) -> None:
        """Raise BuildError, before any work, when the build would need the device and cannot have it."""

    @abstractmethod
    def tuning_builder_runner(self, cores: int, stop: threading.Event) -> tuple[Any, Any]:
        """MetaSchedule's builder and runner for candidates timed on the device (tuning/tune.py's seam), each
        with a `close()` that ends its worker processes."""

    @abstractmethod
    def link_compiler(self) -> str | None:
        """The C compiler that links a library to be loaded there (`export_library`'s; None: TVM's default). A
        command, not a function: the untuned model is compiled and linked in a process of its own."""

    @abstractmethod
    def latency_ms(self, library: Path, inputs: list[np.ndarray], min_total_s: float = 1.0) -> float:
        """Median latency of a compiled model, timed on the device for about `min_total_s` (`time_model`)."""

    @contextmanager
    def thread_wait_timers(self, library: Path, inputs: list[np.ndarray], ways: Sequence[ThreadWait],
                           pool: Path | None = None) -> Iterator[dict[str, Callable[[], float]] | None]:
        """A timer of the model (ms per call, each call a timing) for each of `ways`: "spin", TVM's CPU threads
        spinning while they wait for work (its default), "sleep", "pool" (edgetune's, the library `pool`); None
        where the device cannot start a process with either (over RPC the server's own environment holds)."""
        yield None

    def output_check(self, artifact_dir: Path, manifest: Manifest) -> tuple[str, OutputCheck] | None:
        """The artifact run on the device itself, away from this machine: how, and what came of it. None
        where the verify stage's own runs on this machine are all there is."""
        return None

    def summary(self) -> dict:
        """The build summary's `device`: where it ran, how it was reached, whether it was emulated."""
        return device_summary(self.arch, None)
