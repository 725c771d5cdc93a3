"""Stage: compile. On targets measured here, each kernel's few best schedules are first compared inside
the model (edgetune/selection.py); then the model is compiled with the chosen records and exported as a
library linked for the device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgetune.build.context import TargetBuild
from edgetune.cuda_precompile import precompile_cuda
from edgetune.report.summary import TargetResult

if TYPE_CHECKING:
    from edgetune.selection import Selection


@dataclass(frozen=True)
class CompiledTarget:
    """The exported library, how its CUDA kernels ship (None: not a CUDA target), and the sample inputs."""

    library: Path
    cuda_kernels: str | None
    samples: dict[str, np.ndarray]
    thread_pool: Path | None = None
    """edgetune's thread pool built for the target (thread_pool.py), where the build times it as a way for the
    artifact's threads to wait: a CPU measured here, the recipe leaving the way to the build."""


def compile_stage(ctx: TargetBuild, result: TargetResult, budget_ends: float | None) -> CompiledTarget:
    """The library the artifact ships, and the thread pool it may run its kernels in; `budget_ends` (monotonic
    seconds) bounds the in-model comparison."""
    compiled = _library(ctx, result, budget_ends)
    if not ctx.times_thread_pool:
        return compiled
    from edgetune.thread_pool import POOL_LIBRARY_NAME, build_thread_pool

    return dataclasses.replace(compiled, thread_pool=build_thread_pool(ctx.toolchain.cc,
                                                                       ctx.work_dir / POOL_LIBRARY_NAME))


def _library(ctx: TargetBuild, result: TargetResult, budget_ends: float | None) -> CompiledTarget:
    from edgetune.compile import compile_library, compile_model, export_library

    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    if ctx.device.can_measure:  # timed later: compiled beside this stage's first compile, unless it was already
        ctx.untuned.start()
    samples = ctx.model.sample_inputs()
    database = ctx.store.database
    if ctx.candidates > 1:
        ctx.say(f"timing each kernel's {ctx.candidates} best schedules and its default inside the model")
        selection = _select_in_model(ctx, result, samples, budget_ends)
        if selection.verified_ratio is not None:
            packaged = "it" if selection.verified_ratio < 1 else "the tuner's best"
            ctx.say(f"the chosen schedules' model took {selection.verified_ratio:.3f}x the tuner's best's time, "
                    f"timed whole in turns: {packaged} is packaged")
        if selection.library is not None:  # the comparison compiled and exported what it chose
            return CompiledTarget(selection.library, None, samples)
        database = selection.database
    elif ctx.comparison_cut_by_budget:
        # two ranks: the tuner's best, the default schedules' model, rank 1 and the chosen model (see ranks_that_fit)
        result.selection_skipped = ("comparing two schedules per kernel (four models compiled and timed) does not "
                                    "fit its share of the budget")
    ctx.say(f"compiling with the tuned records ({ctx.toolchain.cc.name})")
    path = ctx.work_dir / "model.so"
    if ctx.profile.device != "cuda":
        library = compile_library(ctx.relax_mod, ctx.tvm_target, database, path, ctx.winograd,
                                  ctx.toolchain.fcompile(), on_skip=_warn(ctx))
        return CompiledTarget(library, None, samples)
    executable = compile_model(ctx.relax_mod, ctx.tvm_target, database, ctx.winograd, on_skip=_warn(ctx))
    cuda_kernels = _precompile_kernels(ctx, executable)
    return CompiledTarget(export_library(executable, path, ctx.toolchain.fcompile()), cuda_kernels, samples)


def _warn(ctx: TargetBuild) -> Callable[[str], None]:
    """compile_model's `on_skip`: a kernel whose tuned schedule does not replay is named in the build's log."""
    return lambda why: ctx.say(f"warning: a tuned schedule does not replay on kernel {why}; that kernel compiles "
                               "unscheduled")


def _select_in_model(ctx: TargetBuild, result: TargetResult, samples: dict[str, np.ndarray],
                     deadline: float | None) -> Selection:
    """The comparison's selection: the database to compile with (each kernel's fastest in the model of its
    tuned best few and its default, timed in the untuned model as compiled apart), and the library of the model
    that stands (the chosen schedules' where they ran faster whole than the tuner's best, else the tuner's
    best), exported by the comparison.

    Fills the result's `selection` summary and each task's `in_model_rank` (0: the tuner's best; None: not
    compared, or `kept_default`: its default schedule beat every tuned one in the model). The models are timed
    on as many of the profile's threads as other programs leave cores free, as the tuner times candidates
    (machine_load.py): on two threads beside a busy loop a kernel runs 3-11x slow and they rank at random.
    """
    import tvm

    from edgetune.machine_load import on_free_cores
    from edgetune.selection import DEFAULT_RANK, select_schedules

    with on_free_cores(ctx.profile.cpu_threads) as threads:  # compared on the cores other programs leave
        selection = select_schedules(ctx.relax_mod, ctx.tvm_target, ctx.store.database, ctx.sample_list(samples),
                                     tvm.device(ctx.profile.device, 0), ctx.candidates, ctx.winograd,
                                     deadline=deadline, untuned=ctx.untuned.library, on_skip=_warn(ctx),
                                     libraries=ctx.work_dir if ctx.profile.device != "cuda" else None,
                                     cross_compiler=ctx.toolchain.fcompile(),
                                     threads=None if threads is None else (threads, ctx.profile.cpu_threads))
    for task in result.tasks:
        choice = selection.choices.get(task["name"])
        task["kept_default"] = choice is not None and choice.rank == DEFAULT_RANK
        task["in_model_rank"] = choice.rank if choice and not task["kept_default"] else None
    result.selection = {
        "candidates": ctx.candidates,
        "models_compiled": selection.models_compiled,
        "seconds": selection.seconds,
        "kernels_changed": sorted(name for name, c in selection.choices.items() if c.rank > 0),
        "kernels_default": sorted(name for name, c in selection.choices.items() if c.rank == DEFAULT_RANK),
        "in_model_us": selection.in_model_us,
        "tuner_best_in_model_us": selection.tuner_best_in_model_us,
        "stopped_by_budget": selection.stopped_by_deadline,
        "verified_ratio": selection.verified_ratio,
        "timed_on_threads": threads,  # of the profile's cpu_threads: fewer while other programs held cores
        "cpu_threads": ctx.profile.cpu_threads,
    }
    return selection


def _precompile_kernels(ctx: TargetBuild, executable) -> str | None:
    """For CUDA targets, embed nvcc's fatbin when a toolkit is here; say which form the kernels ship in."""
    if ctx.profile.device != "cuda":
        return None
    if ctx.toolchain.cuda is None:
        return "CUDA C source, compiled by NVRTC when the library loads on the device (no nvcc found here)"
    arch = ctx.profile.target["arch"]
    form = precompile_cuda(executable, arch, ctx.toolchain.cuda.nvcc)
    return f"{form} for {arch}, precompiled with nvcc {ctx.toolchain.cuda.version}"
