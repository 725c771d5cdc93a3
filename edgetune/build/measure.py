"""Stage: measure. The packaged library, the same model untuned, and the reference, timed where the
device is: on this machine, or on the device over RPC (where the reference cannot run)."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgetune.build.context import TargetBuild


@dataclass(frozen=True)
class Latency:
    """Milliseconds (None: not measured) and where they were measured (None: nowhere)."""

    tuned: float | None = None
    untuned: float | None = None
    reference: float | None = None
    measured_on: str | None = None

    def as_manifest(self) -> dict[str, float | None]:
        """The manifest's `latency_ms`; the reference keeps the key it has always had."""
        return {"tuned": self.tuned, "untuned": self.untuned, "onnxruntime": self.reference}


def measure_stage(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray]) -> Latency:
    if ctx.measured_here:
        ctx.say(f"timing tuned, untuned and {ctx.reference.display_name}")
        return _measure_here(ctx, library, samples)
    if ctx.remote is not None:
        ctx.say(f"timing tuned and untuned on the device ({ctx.remote.where})")
        return _measure_remote(ctx, library, samples)
    return Latency()


def _untuned_library(ctx: TargetBuild, cross_compiler: Callable | None = None) -> Path:
    from edgetune.compile import compile_model, export_library

    executable = compile_model(ctx.relax_mod, ctx.tvm_target, None, ctx.winograd)
    return export_library(executable, ctx.work_dir / "untuned.so", cross_compiler)


def _measure_here(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray]) -> Latency:
    import tvm

    from edgetune.runtime import load_library, time_model, use_cpu_threads

    device = tvm.device(ctx.profile.device, 0)
    inputs = ctx.sample_list(samples)
    untuned = _untuned_library(ctx)
    if ctx.profile.cpu_threads:
        use_cpu_threads(ctx.profile.cpu_threads)  # as many as the reference is given
    return Latency(
        tuned=time_model(load_library(library, device), inputs, device),
        untuned=time_model(load_library(untuned, device), inputs, device),
        reference=ctx.reference.time(samples, threads=ctx.profile.hardware.cores or 1),
        measured_on=f"this build machine ({platform.machine()}, {ctx.profile.hardware.cores} cores)",
    )


def _measure_remote(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray]) -> Latency:
    from edgetune.fleet.session import remote_latency_ms

    inputs = ctx.sample_list(samples)
    untuned = _untuned_library(ctx, ctx.toolchain.fcompile())
    return Latency(
        tuned=remote_latency_ms(ctx.remote, library, inputs),
        untuned=remote_latency_ms(ctx.remote, untuned, inputs),
        measured_on=ctx.remote.where,
    )
