"""Where the hypervisor has put this VM's two CPUs for a timing round: in one core complex, or apart.

On the 2-core AMD VMs the benchmarks run on, the two virtual CPUs spend spells of seconds to minutes in one core
complex (one cache line's round trip between them about 50 ns) and spells apart (about 330 ns; no shared L3).
Apart, every line one thread writes and the other reads crosses between them: a ResNet-50 artifact ran 42.5 ms
against 33.8 ms together, its Winograd kernels (three stages, each split over the threads differently) 1.3-2.3x
slower, while ONNX Runtime lost 9% and single-threaded work nothing. So a ratio timed in one kind of spell does
not hold in the other, and `time_side_by_side` labels each round with its placement.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from timing import c_compiler

NEAR_NS = 150.0
"""A round trip under this: the two CPUs share a core complex (50-125 ns seen); over it: apart (325-535 ns)."""

_TRIPS = 100_000  # 5 ms together, 33 ms apart
_SOURCE = Path(__file__).resolve().parent / "core_distance.c"


class CoreDistance:
    """The round trip of a cache line between the first two CPUs this process may run on (core_distance.c, built
    with the system's C compiler when first asked); None where there is one CPU, no compiler, or a thread could
    not be pinned."""

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))[:2]

    def round_trip_ns(self) -> float | None:
        """The median of three probes, each `_TRIPS` round trips."""
        probe = _probe()
        if probe is None or len(self.cpus) < 2:
            return None
        probes = sorted(probe.core_round_trip_ns(self.cpus[0], self.cpus[1], _TRIPS) for _ in range(3))
        return probes[1] if probes[0] >= 0 else None


@functools.cache
def _probe() -> ctypes.CDLL | None:
    """core_distance.c built into a temporary folder of this process (removed at exit), once; None if it cannot be."""
    compiler = c_compiler()
    if compiler is None:
        return None
    folder = tempfile.mkdtemp(prefix="core-distance-")
    atexit.register(shutil.rmtree, folder, True)
    library = Path(folder) / "core_distance.so"
    try:
        built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(library), str(_SOURCE)],
                               capture_output=True, text=True, check=False)
    except OSError:  # $CC names no program
        return None
    if built.returncode != 0:
        return None
    probe = ctypes.CDLL(str(library))
    probe.core_round_trip_ns.restype = ctypes.c_double
    probe.core_round_trip_ns.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return probe


def placement(before_ns: float | None, after_ns: float | None) -> str:
    """A round's placement from the round trips measured before and after it: "together", "apart", "moved" (it
    changed during the round) or "unknown"."""
    if before_ns is None or after_ns is None:
        return "unknown"
    if (before_ns < NEAR_NS) != (after_ns < NEAR_NS):
        return "moved"
    return "together" if before_ns < NEAR_NS else "apart"
