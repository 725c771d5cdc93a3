"""Compile a model with (or without) a target's tuned records, and time it where it runs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir.meta_schedule.database import Database, MemoryDatabase

from edgetune.frontend.winograd import WinogradPolicy


def compile_model(mod: tvm.IRModule, target: tvm.target.Target, database: Database | None,
                  winograd: WinogradPolicy | None = None):
    """Build with the database's best schedule per kernel; kernels it lacks stay unscheduled.

    The kernels are fused exactly as `fuse_for_tuning` fused them for task extraction, so the tuned
    workloads are found. Where a tuned schedule packs a weight into its own layout (MetaSchedule's
    RewriteLayout, on buffers marked layout-free), the packing is split out of the kernel and folded
    into the constant here, at compile time, instead of running on every call. With no database this
    is the untuned baseline, built by the very same pipeline. `winograd` as in `fuse_for_tuning`.
    """
    from tvm.relax import pipeline
    from tvm.s_tir import dlight

    from edgetune.frontend.onnx import fuse_for_tuning

    database = database if database is not None else MemoryDatabase()
    is_gpu = pipeline.BackendDispatcher.is_gpu_target(target)

    @tvm.transform.module_pass(opt_level=3)
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = tvm.transform.Sequential(pipeline.library_dispatch_passes(target))(mod)
        mod = relax.transform.MetaScheduleApplyDatabase()(fuse_for_tuning(mod, target, winograd))
        prepack = [relax.transform.SplitLayoutRewritePreproc(), relax.transform.FoldConstant()]
        mod = tvm.transform.Sequential(prepack)(mod)  # each weight packed once, here
        if is_gpu:  # untuned GPU kernels need at least thread bindings
            mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                                              dlight.gpu.GeneralReduction(), dlight.gpu.Fallback())(mod)
        return tvm.transform.Sequential(_lowering_passes(target))(mod)

    with target, database, tvm.transform.PassContext(opt_level=3):
        return relax.build(mod, target=target, relax_pipeline=_pipeline)


def _lowering_passes(target: tvm.target.Target) -> list:
    """The target's default dataflow-lowering and finalizing passes; the CPU ones where none are registered."""
    from tvm.relax import pipeline

    try:
        return pipeline.dataflow_lower_passes(target) + pipeline.finalize_passes(target)
    except (ValueError, AttributeError):  # as compile_relax: the wheel's cpu_generic backend lacks them
        return [
            relax.transform.RewriteDataflowReshape(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
            relax.transform.StaticPlanBlockMemory(),
            relax.transform.LowerAllocTensor(),
            relax.transform.KillAfterLastUse(),
            relax.transform.LowerRuntimeBuiltin(),
            relax.transform.ComputePrimValue(),
            relax.transform.VMShapeLower(),
            relax.transform.AttachGlobalSymbol(),
        ]


def export_library(executable, path: Path, cross_compiler: str | None = None) -> Path:
    """Write the executable as one shared object (weights included) that TVM's runtime can load."""
    if cross_compiler:
        from tvm.support import cc

        executable.export_library(str(path), fcompile=cc.cross_compiler(cross_compiler))
    else:
        executable.export_library(str(path))
    return path


_BIG_CORES = 1  # TVM's ThreadGroup affinity mode: threads on the fastest cores, one per core


def use_cpu_threads(cores: int) -> None:
    """Run TVM's CPU kernels on `cores` threads, in this process and in workers it starts later.

    Unless told otherwise, TVM's runtime starts hardware_concurrency / 2 threads on x86, as if every
    core ran two hyper-threads: one thread on a 2-vCPU machine, half of the cores a target is tuned
    for and ONNX Runtime is given. TVM reads the environment variable when a thread's pool starts;
    a pool that ran already can be narrowed, not widened.
    """
    os.environ["TVM_NUM_THREADS"] = str(cores)
    pool_size = tvm.get_global_func("runtime.NumThreads")  # starts this thread's pool if it has not run
    if pool_size() != cores:
        tvm.get_global_func("runtime.config_threadpool")(_BIG_CORES, cores)
    if pool_size() != cores:
        raise RuntimeError(f"TVM's thread pool in this process started with {pool_size()} threads before it was "
                           f"asked for {cores}: set TVM_NUM_THREADS={cores} before running kernels")


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
