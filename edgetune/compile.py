"""Compile a model with (or without) a target's tuned records, and time it where it runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir.meta_schedule.database import Database, MemoryDatabase
from tvm.s_tir.meta_schedule.relax_integration import compile_relax


def compile_model(mod: tvm.IRModule, target: tvm.target.Target, database: Database | None):
    """Build with the database's best schedule per kernel; kernels it lacks stay unscheduled.

    With no database this is the untuned baseline, built by the very same pipeline.
    """
    return compile_relax(database if database is not None else MemoryDatabase(), mod, target, params=None)


def export_library(executable, path: Path, cross_compiler: str | None = None) -> Path:
    """Write the executable as one shared object (weights included) that TVM's runtime can load."""
    if cross_compiler:
        from tvm.support import cc

        executable.export_library(str(path), fcompile=cc.cross_compiler(cross_compiler))
    else:
        executable.export_library(str(path))
    return path


def load_library(path: Path, device: tvm.runtime.Device) -> relax.VirtualMachine:
    return relax.VirtualMachine(tvm.runtime.load_module(str(path)), device)


def run(vm: relax.VirtualMachine, inputs: list[np.ndarray], device: tvm.runtime.Device) -> list[np.ndarray]:
    result = vm["main"](*[tvm.runtime.tensor(x, device) for x in inputs])
    return _flatten(result)


def _flatten(result) -> list[np.ndarray]:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [array for item in result for array in _flatten(item)]


def time_model(
    vm: relax.VirtualMachine, inputs: list[np.ndarray], device: tvm.runtime.Device, min_total_s: float = 1.0
) -> float:
    """Median latency in milliseconds over several repeats, each at least ~0.1 s long."""
    args = [tvm.runtime.tensor(x, device) for x in inputs]
    vm["main"](*args)  # warm-up: first call allocates
    timer = vm.time_evaluator("main", device, number=1, repeat=5, min_repeat_ms=int(min_total_s * 1000 / 5))
    return float(timer(*args).median) * 1e3
