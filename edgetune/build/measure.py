"""Stage: measure. The packaged library, the same model untuned, and the reference, timed where the
device is: on this machine, or on the device over RPC (where the reference cannot run)."""

from __future__ import annotations

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


def measure_stage(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray],
                  untuned: Path | None = None) -> Latency:
    """Time the tuned and the untuned model on the target's device; the reference only beside them here.
    `untuned`: the untuned model's library when the compile stage built it already."""
    device = ctx.device
    if not device.can_measure:
        return Latency()
    if device.runs_here:
        ctx.say(f"timing tuned, untuned and {ctx.reference.display_name}")
    else:
        ctx.say(f"timing tuned and untuned on the device ({device.where})")
    inputs = ctx.sample_list(samples)
    untuned = untuned or _untuned_library(ctx, device.export_function())
    tuned_ms, untuned_ms = device.latency_ms(library, inputs), device.latency_ms(untuned, inputs)
    reference_ms = ctx.reference.time(samples, threads=ctx.profile.hardware.cores or 1) if device.runs_here else None
    return Latency(tuned=tuned_ms, untuned=untuned_ms, reference=reference_ms, measured_on=device.where)


def _untuned_library(ctx: TargetBuild, cross_compiler: Callable | None) -> Path:
    from edgetune.compile import compile_model, export_library

    executable = compile_model(ctx.relax_mod, ctx.tvm_target, None, ctx.winograd)
    return export_library(executable, ctx.work_dir / "untuned.so", cross_compiler)
