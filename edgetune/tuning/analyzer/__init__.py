"""Symbol-based analyzer: the cheap draft model of draft-then-verify search.

It estimates a candidate's latency analytically from its loop nest and the device profile's
hardware numbers (`cpu.py`, `gpu.py`), scoring a design space's *decisions* many at a time
(`space.py`) without building schedules; `tir.py` reads concrete TIR for the fallback.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgetune.profiles import Hardware
from edgetune.tuning.analyzer.cpu import CpuAnalyzer
from edgetune.tuning.analyzer.gpu import GpuAnalyzer
from edgetune.tuning.analyzer.nest import Nest
from edgetune.tuning.analyzer.space import SpaceModel, UnsupportedSpace
from edgetune.tuning.analyzer.tir import nests_from_func

__all__ = ["Analyzer", "CpuAnalyzer", "GpuAnalyzer", "Nest", "SpaceModel", "UnsupportedSpace", "make_analyzer",
           "nests_from_func"]


class Analyzer(Protocol):
    def latency(self, nests: list[Nest]) -> np.ndarray:
        """[N] estimated seconds for N candidates described by the same statements."""
        ...


def make_analyzer(hardware: Hardware, device: str, isa: str = "x86_64") -> Analyzer:
    """The analyzer for a profile's runtime device ("cpu", "cuda", "opencl")."""
    if device == "cpu":
        return CpuAnalyzer(hardware, isa)
    return GpuAnalyzer(hardware)
