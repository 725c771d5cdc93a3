"""Compile a model with (or without) a target's tuned records and export it as a library (runtime.py runs it)."""

from __future__ import annotations

import multiprocessing
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tvm
from tvm import relax
from tvm.s_tir.meta_schedule.database import Database, MemoryDatabase

from edgetune.frontend.winograd import WinogradPolicy
from edgetune.weight_packing import fold_weight_packing

KERNEL_GROUPS = 2
"""A CPU model's kernels are lowered and turned into machine code in this many groups at once, one process each
(this one and others): LLVM works on one thread, and a GoogLeNet's kernels took 37 s to lower and 20-28 s more
to write as machine code on a 2-core Zen 1 VM. A fixed number, not the machine's cores: the groups decide the
library's bytes, which must not depend on where it is built. The other processes start (3-4 s: importing TVM)
while this one runs the relax passes."""
HELPED_MIN_OPERATORS = 40
"""A model calling fewer operators has its groups built in this process: another process's start (3-4 s)
costs more than half of such a model's kernels take to build (the zoo's tiny_cnn calls 10 operators,
ResNet-18 70, MobileNet-V2 188)."""


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
    database = database if database is not None else MemoryDatabase()
    with target, database, tvm.transform.PassContext(opt_level=3):
        return relax.build(mod, target=target, relax_pipeline=_relax_pipeline(target, database, winograd, on_skip))


def compile_library(mod: tvm.IRModule, target: tvm.target.Target, database: Database | None, path: Path,
                    winograd: WinogradPolicy | None = None, cross_compiler: Any = None,
                    on_skip: Callable[[str], None] | None = None) -> Path:
    """`compile_model` and `export_library` in one: the library at `path`. On a CPU target the kernels are
    lowered and written as machine code in KERNEL_GROUPS processes at once (this one and others, started first,
    while this one runs the relax passes), each group's object linked into the one library: the same kernels
    and constants as `compile_model`'s."""
    from edgetune.isolated import processes_with

    if target.kind.name != "llvm":
        return export_library(compile_model(mod, target, database, winograd, on_skip), path, cross_compiler)
    # a small model, or a daemon process (build/untuned.py's compile apart, which may start none), builds every
    # group here: the same groups, the same bytes
    helpers = KERNEL_GROUPS - 1
    if multiprocessing.current_process().daemon or operator_calls(mod) < HELPED_MIN_OPERATORS:
        helpers = 0
    with tempfile.TemporaryDirectory(prefix="edgetune-kernels-") as scratch, processes_with(
            [{}] * helpers) as pools:
        builder, kernels, attrs = _lowered_for_vm(mod, target, database, winograd, on_skip)
        groups = _kernel_groups(kernels, KERNEL_GROUPS) if kernels is not None else []
        objects = [str(Path(scratch) / f"kernels{index}.o") for index in range(len(groups))]
        target_json = tvm.ir.save_json(target)
        local = len(groups) - min(len(pools), max(len(groups) - 1, 0))  # the first group is always built here
        elsewhere = [pool.submit(build_kernel_object, tvm.ir.save_json(group), target_json, obj)
                     for pool, group, obj in zip(pools, groups[local:], objects[local:], strict=False)]
        here = [build_kernel_object(group, target, obj) for group, obj in zip(groups[:local], objects, strict=False)]
        libraries = [tvm.runtime.load_static_library(obj, names) for obj, names in
                     zip(objects, here + [future.result() for future in elsewhere], strict=True)]
        with target, tvm.transform.PassContext(opt_level=3):  # no kernel: what export reads the target from
            anchor = tvm.tirx.build(tvm.IRModule({}), target=target)
        executable = relax.VMExecutable(relax._ffi_api.VMLink(
            builder, target, anchor, [*attrs.get("external_mods", []), *libraries],
            dict(attrs.get("const_name_to_constant", {}))))
        return export_library(executable, path, cross_compiler)


def operator_calls(mod: tvm.IRModule) -> int:
    """How many operators the model calls: about how many kernels it compiles to, known before its passes run (what
    decides whether another process's start pays off: here and in build/untuned.py)."""
    calls = [0]

    def count(expr: relax.Expr) -> None:
        calls[0] += isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)

    for function in mod.functions.values():
        if isinstance(function, relax.Function):
            relax.analysis.post_order_visit(function, count)
    return calls[0]


def _lowered_for_vm(mod: tvm.IRModule, target: tvm.target.Target, database: Database | None,
                    winograd: WinogradPolicy | None, on_skip: Callable[[str], None] | None) -> tuple:
    """relax.build's steps before it builds the kernels (TVM 0.27, pinned): the VM's code (its builder), the
    kernels as one TIR module (None: no kernel), and the lowered module's attributes (external modules, named
    constants)."""
    from tvm.relax import vm_build

    database = database if database is not None else MemoryDatabase()
    with target, database, tvm.transform.PassContext(opt_level=3):
        lowered = _relax_pipeline(target, database, winograd, on_skip)(mod)
        builder = relax.ExecBuilder()
        kernels = vm_build._filter_tir(vm_build._vmcodegen(builder, lowered, "bytecode"))
    if kernels is not None:
        kernels = vm_build._auto_attach_system_lib_prefix(kernels, target, None)
    return builder, kernels, dict(lowered.attrs) if lowered.attrs else {}


def build_kernel_object(kernels: tvm.IRModule | str, target: tvm.target.Target | str, object_path: str) -> list[str]:
    """A group of kernels (a TIR module, or its JSON from another process) built for the target and written as
    one object file; the names of the functions it holds."""
    kernels = tvm.ir.load_json(kernels) if isinstance(kernels, str) else kernels
    target = tvm.ir.load_json(target) if isinstance(target, str) else target
    with target, tvm.transform.PassContext(opt_level=3):
        tvm.tirx.build(kernels, target=target).write_to_file(object_path)
    return [str(function.attrs["global_symbol"]) for function in kernels.functions.values()]


def _kernel_groups(kernels: tvm.IRModule, count: int) -> list[tvm.IRModule]:
    """The kernels in `count` groups of about equal size (by the length of their text, the largest first, each to
    the group holding least), in an order that depends only on the kernels."""
    sized = sorted(((len(function.script()), gvar.name_hint, gvar, function)
                    for gvar, function in kernels.functions_items()), key=lambda item: (-item[0], item[1]))
    groups: list[dict] = [{} for _ in range(count)]
    loads = [0] * count
    for size, _, gvar, function in sized:
        lightest = loads.index(min(loads))
        groups[lightest][gvar] = function
        loads[lightest] += size
    return [tvm.IRModule(group, attrs=kernels.attrs) for group in groups if group]


def _relax_pipeline(target: tvm.target.Target, database: Database, winograd: WinogradPolicy | None,
                    on_skip: Callable[[str], None] | None) -> tvm.transform.Pass:
    """The relax passes of `compile_model`: fusion as for tuning, the database applied, weights packed, lowered."""
    from tvm.relax import pipeline
    from tvm.s_tir import dlight

    from edgetune.frontend.onnx import fuse_for_tuning

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

    return _pipeline


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
    return compile_library(mod, target, None, path, winograd, cross_compiler)
