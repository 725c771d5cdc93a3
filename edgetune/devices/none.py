"""A device this machine can compile for but not run on (another architecture or a GPU, no connection):
its artifact is built from the records its store holds; measure and verify say they did not run."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from edgetune.devices.base import Device
from edgetune.errors import BuildError


class UnreachableDevice(Device):
    """Target `target`'s `kind` device ("cpu", "cuda", ...) of architecture `arch`, reached by no connection."""

    def __init__(self, arch: str, target: str, kind: str) -> None:
        super().__init__(arch)
        self.target = target
        self.kind = kind

    @property
    def where(self) -> None:
        return None

    def check_reachable(self, trials_per_task: int | None) -> None:
        """Tuning needs the device: only trials_per_task: 0 (compile with the stored records) goes on."""
        if trials_per_task != 0:
            self._refuse()

    def tuning_builder_runner(self, cores: int, stop: threading.Event) -> tuple[Any, Any]:
        self._refuse()

    def link_compiler(self) -> str | None:
        self._refuse()

    def latency_ms(self, library: Path, inputs: list[np.ndarray], min_total_s: float = 1.0) -> float:
        self._refuse()

    def _refuse(self) -> NoReturn:
        raise BuildError(
            f"target '{self.target}': a {self.arch}/{self.kind} device cannot be measured on this "
            "machine; give it an RPC connection, or set tuning.trials_per_task: 0 to compile it with the "
            "records its store already holds"
        )
