"""Stage: package. The artifact's files (library, sample input and the reference's output, run.py,
deploy/, README, io.json), optionally TVM's runtime for the device with a built deploy program, and the
manifest that describes them; the verify stage completes and writes the manifest."""

from __future__ import annotations

import json
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import edgetune
from edgetune.build.compile import CompiledTarget
from edgetune.build.context import TargetBuild
from edgetune.build.measure import Latency
from edgetune.frontend.model import LoadedModel
from edgetune.package.artifact import stage_artifact
from edgetune.package.deploy import build_program, stage_runtime
from edgetune.package.manifest import (
    LatencyFacts,
    Manifest,
    ModelFacts,
    ModelInput,
    RecipeFacts,
    TargetFacts,
    ThreadWaitFacts,
    ToolchainFacts,
    TuningFacts,
    Verification,
)
from edgetune.package.runtime import runtime_files
from edgetune.recipe import recipe_hash
from edgetune.report.summary import TargetResult
from edgetune.runtime import spin_count


@dataclass(frozen=True)
class PackagedTarget:
    """The artifact staged beside its final directory (complete but for the verification and the manifest),
    its manifest so far, and the bundled runtime's directory inside it (None when not bundled)."""

    directory: Path
    manifest: Manifest
    runtime_dir: Path | None


def package_stage(ctx: TargetBuild, result: TargetResult, compiled: CompiledTarget, latency: Latency,
                  inputs_hash: str) -> PackagedTarget:
    """Stage the artifact beside `ctx.artifact_dir`; the verify stage puts it in place once complete."""
    expected = ctx.reference.run(compiled.samples)
    pooled = latency.thread_wait is not None and latency.thread_wait.policy == "pool"
    staging = stage_artifact(ctx.artifact_dir, library=compiled.library, sample_inputs=compiled.samples,
                             reference_outputs=expected, template_context=_template_context(ctx, latency),
                             thread_pool=compiled.thread_pool if pooled else None)
    try:
        runtime_dir = None
        if ctx.recipe.package.bundle_runtime:
            arch = ctx.toolchain.arch
            ctx.say(f"bundling TVM's {arch} runtime and building the C++ deploy program")
            runtime_dir = stage_runtime(runtime_files(arch), staging / "runtime")
            build_program(staging / "deploy", ctx.toolchain, runtime_dir, staging / "bin" / "deploy")
        manifest = _manifest(ctx, result, compiled, latency, inputs_hash, runtime_dir is not None)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return PackagedTarget(staging, manifest, runtime_dir)


def _manifest(ctx: TargetBuild, result: TargetResult, compiled: CompiledTarget, latency: Latency,
              inputs_hash: str, runtime_bundled: bool) -> Manifest:
    """Everything but the verification's outcome and the files' checksums, which the verify stage adds."""
    recipe, model, profile, tuning = ctx.recipe, ctx.model, ctx.profile, ctx.recipe.tuning
    return Manifest(
        edgetune_version=edgetune.__version__,
        build_inputs_sha256=inputs_hash,
        recipe=RecipeFacts(name=recipe.name, sha256=recipe_hash(recipe)),
        model=ModelFacts(
            name=model.name,
            sha256=model.sha256,
            inputs=[ModelInput(name=i.name, shape=list(i.shape), dtype=i.dtype) for i in model.inputs],
            outputs=list(model.output_names),
        ),
        target=TargetFacts(
            name=ctx.name,
            profile=profile.name,
            device=profile.device,
            isa=profile.isa,
            arch=ctx.toolchain.arch,
            tvm_target=json.loads(json.dumps(profile.target)),
            tvm_host=json.loads(json.dumps(profile.host)),
        ),
        versions=_versions(),
        toolchain=ToolchainFacts(**ctx.toolchain.describe()),
        cuda_kernels=compiled.cuda_kernels,
        runtime_bundled=runtime_bundled,
        tuning=TuningFacts(
            search=tuning.search,
            trials_per_task=tuning.trials_per_task,
            time_budget_min=tuning.time_budget_min,
            seed=tuning.seed,
            winograd=tuning.winograd,
            tasks_total=result.tasks_total,
            trials_total=result.trials_total,
            tasks=result.tasks,
        ),
        latency_ms=LatencyFacts(**latency.as_manifest()),
        measured_on=latency.measured_on,
        **({"thread_wait": ThreadWaitFacts(**vars(latency.thread_wait))} if latency.thread_wait else {}),
        verification=Verification(reference=ctx.reference.name, rtol=recipe.verify.rtol, atol=recipe.verify.atol),
        files={},  # write_manifest lists them once the artifact is complete
    )


def _template_context(ctx: TargetBuild, latency: Latency) -> dict[str, Any]:
    """What the artifact's io.json and templates are made from. Names stay strings here: the README
    escapes every value it prints, the code templates refuse any but numbers and plain words."""
    import tvm

    def ms(value: float | None) -> str:
        return f"{value:.3f} ms" if value is not None else "not measured"

    recipe, profile, model = ctx.recipe, ctx.profile, ctx.model
    return {
        "model_name": model.name,
        "target_name": ctx.name,
        "recipe_name": recipe.name,
        "recipe_hash": recipe_hash(recipe),
        "profile": profile.name,
        "tvm_target": json.dumps(profile.target, sort_keys=True),
        "device": profile.device,
        "cpu_threads": profile.cpu_threads,
        "cpu_thread_spin_count": spin_count(latency.thread_wait.policy if latency.thread_wait else None),
        "thread_wait_chosen_by": latency.thread_wait.chosen_by if latency.thread_wait else None,
        "arch": ctx.toolchain.arch,
        "cxx": ctx.toolchain.cxx.name if ctx.toolchain.cxx else "g++",
        "edgetune_version": edgetune.__version__,
        "tvm_package": f"apache-tvm=={tvm.__version__}",
        "output_names": list(model.output_names),
        "inputs": [
            {"name": i.name, "shape": [int(d) for d in i.shape], "dl_code": _DL_CODES[np.dtype(i.dtype).kind],
             "bits": np.dtype(i.dtype).itemsize * 8, **_index_range(model, i.name)}
            for i in model.inputs
        ],
        "rtol": recipe.verify.rtol,
        "atol": recipe.verify.atol,
        "measured_on": latency.measured_on if latency.tuned is not None else "no device (not measured)",
        "tuned_text": ms(latency.tuned),
        "untuned_text": ms(latency.untuned),
        "reference_text": ms(latency.reference),
    }


_DL_CODES = {"f": "kDLFloat", "i": "kDLInt", "u": "kDLUInt", "b": "kDLBool"}
"""DLPack's type code per numpy dtype kind, for the deploy program's input tensors."""


def _index_range(model: LoadedModel, name: str) -> dict[str, int | None]:
    """The ids an index input may hold, [index_from, index_limit): a table's rows, counted from its end too where
    the model does (ONNX); both None for an input that indexes no table."""
    limit = model.index_limits.get(name)
    if limit is None:
        return {"index_limit": None, "index_from": None}
    return {"index_limit": limit, "index_from": -limit if model.counts_negative_ids else 0}


def _versions() -> dict[str, str]:
    import onnxruntime
    import tvm
    from tvm.target import codegen

    return {
        "tvm": tvm.__version__,
        "llvm": str(codegen.llvm_version_major()),
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
