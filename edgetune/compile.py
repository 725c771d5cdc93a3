"""Compile a model with (or without) a target's tuned records and export it as a library (runtime.py runs it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import relax
from tvm.s_tir.meta_schedule.database import Database, MemoryDatabase

from edgetune.frontend.winograd import WinogradPolicy
from edgetune.weight_packing import fold_weight_packing


def compile_model(mod: tvm.IRModule, target: tvm.target.Target, database: Database | None,
                  winograd: WinogradPolicy | None = None,
                  on_skip: Callable[[str], None] | None = None) -> tvm.runtime.Executable:
    """Build with the database's best schedule per kernel; kernels it lacks stay unscheduled.

    The kernels are fused exactly as `fuse_for_tuning` fused them for task extraction, so the tuned
    workloads are found. Where a tuned schedule packs a weight into its own layout (MetaSchedule's
    RewriteLayout, on buffers marked layout-free), the packing is split out of the kernel and folded
    into the constant here, at compile time, instead of running on every call (in numpy where it is a
    copy: `weight_packing.py`). With no database this is the untuned baseline, built by the very same
    pipeline. `winograd` as in `fuse_for_tuning`;
    `on_skip` hears of each kernel whose record does not replay on it (see `unreplayable_kernels`).
    """
    from tvm.relax import pipeline
    from tvm.s_tir import dlight

    from edgetune.frontend.onnx import fuse_for_tuning

    database = database if database is not None else MemoryDatabase()
    is_gpu = pipeline.BackendDispatcher.is_gpu_target(target)
    fold_packing = tvm.transform.module_pass(lambda mod, _ctx: fold_weight_packing(mod), opt_level=0,
                                             name="FoldWeightPacking")

    @tvm.transform.module_pass(opt_level=3)
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = tvm.transform.Sequential(pipeline.library_dispatch_passes(target))(mod)
        mod = _apply_database(fuse_for_tuning(mod, target, winograd), target, database, on_skip)
        prepack = [relax.transform.SplitLayoutRewritePreproc(), fold_packing, relax.transform.FoldConstant()]
        mod = tvm.transform.Sequential(prepack)(mod)  # each weight packed once, here (in numpy where it can be)
        if is_gpu:  # untuned GPU kernels need at least thread bindings
            mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul(), dlight.gpu.GEMV(), dlight.gpu.Reduction(),
                                              dlight.gpu.GeneralReduction(), dlight.gpu.Fallback())(mod)
        return tvm.transform.Sequential(_lowering_passes(target))(mod)

    with target, database, tvm.transform.PassContext(opt_level=3):
        return relax.build(mod, target=target, relax_pipeline=_pipeline)


def unreplayable_kernels(mod: tvm.IRModule, target: tvm.target.Target, database: Database,
                         on_skip: Callable[[str], None] | None = None) -> list:
    """The kernels of `mod` whose record in `database` does not replay on them, each named to `on_skip`.

    Kernels are matched to records by anchor block, so a record tuned on `matmul` is also offered to
    `matmul + add`. On a transformer block such a trace met a buffer written by two blocks in the other
    kernel (ScheduleError in cache-read) and relax's MetaScheduleApplyDatabase failed the whole build."""
    failing = []
    for global_var, function in mod.functions_items():
        if not isinstance(function, tvm.tirx.PrimFunc) or function.attrs.get("tir.is_scheduled", False):
            continue
        try:  # the very pass the build runs, on this kernel alone
            with database:
                relax.transform.MetaScheduleApplyDatabase()(tvm.IRModule({global_var: function}))
        except Exception as exc:  # TVM's ScheduleError and friends: the trace does not apply to this kernel
            failing.append(global_var)
            if on_skip is not None:
                on_skip(f"{global_var.name_hint}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
    return failing


def _apply_database(mod: tvm.IRModule, target: tvm.target.Target, database: Database,
                    on_skip: Callable[[str], None] | None) -> tvm.IRModule:
    """MetaScheduleApplyDatabase on every kernel but those whose record does not replay on them: they
    compile unscheduled, as kernels without records do."""
    failing = set(unreplayable_kernels(mod, target, database, on_skip))
    if not failing:
        return relax.transform.MetaScheduleApplyDatabase()(mod)
    applied = relax.transform.MetaScheduleApplyDatabase()(tvm.IRModule(
        {gv: f for gv, f in mod.functions_items() if gv not in failing}, attrs=mod.attrs))
    functions = {**dict(applied.functions_items()), **{gv: mod[gv] for gv in failing}}
    return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)


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
    """Write the executable as one shared object (weights included) that TVM's runtime can load, linked by
    `cross_compiler` (a C compiler command; None: TVM's default)."""
    if cross_compiler:
        from tvm.support import cc

        executable.export_library(str(path), fcompile=cc.cross_compiler(cross_compiler))
    else:
        executable.export_library(str(path))
    return path


def export_untuned(mod: tvm.IRModule, target: tvm.target.Target, winograd: WinogradPolicy | None, path: Path,
                   cross_compiler: str | None) -> Path:
    """The untuned model (no records) compiled and exported to `path` (its directory made if need be): what
    build/untuned.py runs, in its process or in this one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return export_library(compile_model(mod, target, None, winograd), path, cross_compiler)
