"""Candidate builder: TVM's LocalBuilder with a build function that skips the 10-second import.

TVM's default build function imports `tvm.s_tir.tensor_intrin` (mostly CUDA intrinsics) in every
freshly started worker, i.e. once per batch; for the targets edgetune tunes on the CPU that import
buys nothing, so this build function does the same lowering without it.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm.s_tir.meta_schedule.builder import LocalBuilder


def build_candidate(mod, target, _params):
    """MetaSchedule's default build, minus the tensor-intrinsic import (runs in a builder worker)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def create_builder(
    max_workers: int,
    timeout_sec: float = 60.0,
    initializer: Callable[[], None] | None = None,
    f_export: Callable | None = None,
) -> LocalBuilder:
    """`f_export` None keeps TVM's `.tar` export (linked where it runs); a device gets linked `.so` files."""
    return LocalBuilder(
        max_workers=max_workers, timeout_sec=timeout_sec, f_build=build_candidate, f_export=f_export,
        initializer=initializer,
    )
