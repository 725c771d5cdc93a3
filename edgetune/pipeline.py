"""build(recipe): every stage in order for each target of the fleet.

recipe -> model import -> tasks -> tuning -> compile -> package -> verify. Each target's
measurements live in its own record store under `<output>/<recipe>/work/<target>/`; a target whose
inputs (model, profile, tuning settings, records) hash the same as its packaged artifact's is not
compiled or packaged again.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import edgetune
from edgetune.errors import BuildError, EdgetuneError, InputError
from edgetune.frontend.onnx import LoadedModel, fuse_for_tuning, load_model, to_relax
from edgetune.package.artifact import archive_artifact, sha256_file, write_artifact
from edgetune.package.verify import check_native_outputs, checksum_problems, compare_outputs, read_manifest
from edgetune.profiles import DeviceProfile, resolve_profile
from edgetune.recipe import FleetTarget, Recipe, recipe_hash
from edgetune.reference import ReferenceRuntime
from edgetune.report import render_report
from edgetune.tuning.records import RecordStore
from edgetune.tuning.tasks import extract_tasks
from edgetune.tuning.tune import TaskProgress, TuningInterrupted, TuningPlan, tune

SUMMARY_NAME = "summary.json"
"""Written beside the artifacts by every build: the same JSON as `--json`."""


@dataclass
class TargetResult:
    """What a build produced for one target; the JSON summary is made of these."""

    name: str
    artifact: str | None = None
    artifact_dir: str | None = None
    latency_ms: float | None = None
    untuned_latency_ms: float | None = None
    reference_latency_ms: float | None = None
    verified: bool = False
    max_abs_error: float | None = None
    trials_measured: int = 0
    trials_total: int = 0
    tasks: list[dict[str, Any]] = field(default_factory=list)
    reused: bool = False  # inputs unchanged: the packaged artifact was kept
    error: str | None = None
    wall_s: float = 0.0


@dataclass
class BuildResult:
    recipe: str
    output_dir: str
    targets: dict[str, TargetResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(t.error is None and t.verified for t in self.targets.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "output_dir": self.output_dir,
            "ok": self.ok,
            "targets": {name: asdict(t) for name, t in self.targets.items()},
        }


@dataclass(frozen=True)
class Event:
    """A line of progress for whoever drives the build (the CLI prints these)."""

    target: str
    message: str
    task: TaskProgress | None = None


EventFn = Callable[[Event], None]


def build(recipe: Recipe, only: list[str] | None = None, on_event: EventFn | None = None) -> BuildResult:
    """Build every target of the recipe (or those named in `only`); one target's failure spares the rest."""
    emit = on_event or (lambda event: None)
    targets = _select(recipe, only)
    result = BuildResult(recipe.name, str(recipe.output_dir / recipe.name))
    model = load_model(
        zoo=recipe.model.zoo, onnx_path=recipe.model_path, input_shapes=recipe.model.input_shapes
    )
    profiles = {t.name: resolve_profile(t.profile, t.overrides) for t in targets}
    relax_mod = to_relax(model)
    reference = ReferenceRuntime(model)
    for target in targets:
        started = time.monotonic()
        try:
            result.targets[target.name] = _build_target(
                recipe, target, profiles[target.name], model, relax_mod, reference, emit
            )
        except TuningInterrupted:
            raise
        except EdgetuneError as exc:
            result.targets[target.name] = TargetResult(target.name, error=str(exc))
        except Exception as exc:  # TVM or a toolchain failed on this target; the others still build
            result.targets[target.name] = TargetResult(
                target.name, error=f"target '{target.name}': {type(exc).__name__}: {exc}"
            )
        outcome = result.targets[target.name]
        outcome.wall_s = time.monotonic() - started
        if outcome.error:
            emit(Event(target.name, f"failed: {outcome.error}"))
    summary_path = Path(result.output_dir) / SUMMARY_NAME
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    render_report(summary_path.parent)
    return result


def _select(recipe: Recipe, only: list[str] | None) -> list[FleetTarget]:
    if not only:
        return list(recipe.fleet)
    names = [t.name for t in recipe.fleet]
    unknown = [n for n in only if n not in names]
    if unknown:
        where = recipe.source_path or "recipe"
        raise InputError(f"--target {', '.join(unknown)}: not in {where}'s fleet; its targets are {', '.join(names)}")
    return [t for t in recipe.fleet if t.name in only]


def _build_target(
    recipe: Recipe,
    target: FleetTarget,
    profile: DeviceProfile,
    model: LoadedModel,
    relax_mod,
    reference: ReferenceRuntime,
    emit: EventFn,
) -> TargetResult:
    import tvm

    if not target.is_local:
        raise BuildError(
            f"target '{target.name}': tuning through an RPC tracker is not available yet; "
            "only targets measured on this machine (connection: local) can be built"
        )
    if not profile.is_native:
        raise BuildError(
            f"target '{target.name}': profile '{profile.name}' ({profile.isa}) cannot run on this machine, "
            "and it has no RPC connection to measure it on"
        )
    tvm_target = profile.tvm_target()
    root = recipe.output_dir / recipe.name
    work = root / "work" / target.name
    store = RecordStore(work / "records")

    emit(Event(target.name, f"extracting tasks for {profile.name} ({_describe_target(profile)})"))
    tasks = extract_tasks(fuse_for_tuning(relax_mod, tvm_target), tvm_target)
    tuned_tasks = tasks[: recipe.tuning.max_tasks] if recipe.tuning.max_tasks else tasks
    plan = TuningPlan(
        trials_per_task=recipe.tuning.trials_per_task or 1_000_000,
        time_budget_s=recipe.tuning.time_budget_min * 60 if recipe.tuning.time_budget_min else None,
        search=recipe.tuning.search,
        seed=recipe.tuning.seed,
        cores=profile.hardware.cores or 1,
    )
    emit(Event(target.name, f"{len(tasks)} tasks, tuning {len(tuned_tasks)} with {plan.search} search"))
    tuning = tune(tuned_tasks, tvm_target, store, plan, lambda p: emit(Event(target.name, "", p)))
    summary = [
        {
            "name": t.name,
            "weight": t.weight,
            "flops": t.flops,
            "trials": t.trials_before + t.trials_measured,
            "trials_measured_now": t.trials_measured,
            "best_us": t.best_us,
            "gflops": t.gflops,
            "skipped_for_budget": t.skipped_for_budget,
        }
        for t in tuning.tasks
    ]
    result = TargetResult(
        target.name,
        trials_measured=tuning.trials_measured,
        trials_total=sum(t["trials"] for t in summary),
        tasks=summary,
    )

    artifact_dir = root / target.name
    archive = root / f"{target.name}.tar.gz"
    inputs_hash = _inputs_hash(recipe, target, profile, model, store)
    if _reusable(artifact_dir, archive, inputs_hash):
        emit(Event(target.name, "inputs unchanged: keeping the packaged artifact"))
        manifest = read_manifest(artifact_dir)
        _fill_from_manifest(result, manifest, artifact_dir, archive)
        result.reused = True
        return result

    emit(Event(target.name, "compiling with the tuned records"))
    from edgetune.compile import compile_model, export_library, load_library, time_model

    device = tvm.device(profile.device, 0)
    work.mkdir(parents=True, exist_ok=True)
    library = export_library(compile_model(relax_mod, tvm_target, store.database), work / "model.so")
    samples = model.sample_inputs()
    sample_list = [samples[i.name] for i in model.inputs]
    expected = reference.run(samples)

    emit(Event(target.name, "verifying against ONNX Runtime and timing"))
    vm = load_library(library, device)
    from edgetune.compile import run as run_vm

    check = compare_outputs(
        dict(zip(model.output_names, run_vm(vm, sample_list, device))), expected,
        recipe.verify.rtol, recipe.verify.atol,
    )
    tuned_ms = time_model(vm, sample_list, device)
    untuned_ms = time_model(load_library(export_library(compile_model(relax_mod, tvm_target, None),
                                                        work / "untuned.so"), device), sample_list, device)
    reference_ms = reference.time(samples, threads=profile.hardware.cores or 1)

    manifest = {
        "edgetune_version": edgetune.__version__,
        "build_inputs_sha256": inputs_hash,
        "recipe": {"name": recipe.name, "sha256": recipe_hash(recipe)},
        "model": {
            "name": model.name,
            "sha256": model.sha256,
            "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in model.inputs],
            "outputs": list(model.output_names),
        },
        "target": {
            "name": target.name,
            "profile": profile.name,
            "device": profile.device,
            "tvm_target": json.loads(json.dumps(profile.target)),
            "isa": profile.isa,
        },
        "versions": _versions(),
        "tuning": {
            "search": plan.search,
            "trials_per_task": recipe.tuning.trials_per_task,
            "time_budget_min": recipe.tuning.time_budget_min,
            "seed": plan.seed,
            "tasks_total": len(tasks),
            "trials_total": result.trials_total,
            "tasks": summary,
        },
        "latency_ms": {"tuned": tuned_ms, "untuned": untuned_ms, "onnxruntime": reference_ms},
        "measured_on": f"this build machine ({platform.machine()}, {profile.hardware.cores} cores)",
        "verification": {
            "reference": "onnxruntime",
            "rtol": recipe.verify.rtol,
            "atol": recipe.verify.atol,
            "max_abs_error": check.max_abs_error,
            "matches": check.matches,
        },
    }
    write_artifact(
        artifact_dir,
        library=library,
        sample_inputs=samples,
        reference_outputs=expected,
        manifest=manifest,
        template_context={
            "model_name": model.name,
            "target_name": target.name,
            "recipe_name": recipe.name,
            "recipe_hash": recipe_hash(recipe),
            "profile": profile.name,
            "tvm_target": json.dumps(profile.target, sort_keys=True),
            "device": profile.device,
            "edgetune_version": edgetune.__version__,
            "tvm_package": f"apache-tvm=={tvm.__version__}",
            "input_names": repr([i.name for i in model.inputs]),
            "output_names": repr(list(model.output_names)),
            "rtol": recipe.verify.rtol,
            "atol": recipe.verify.atol,
            "measured_on": manifest["measured_on"],
            "latency_ms": tuned_ms,
            "untuned_text": f"{untuned_ms:.3f} ms",
            "reference_text": f"{reference_ms:.3f} ms",
        },
    )
    # Verify what ships, not what is in memory: the packaged files, loaded afresh.
    problems = checksum_problems(artifact_dir, read_manifest(artifact_dir))
    shipped = check_native_outputs(artifact_dir, read_manifest(artifact_dir))
    archive_artifact(artifact_dir, archive)
    _fill_from_manifest(result, read_manifest(artifact_dir), artifact_dir, archive)
    if problems:
        result.verified = False
        result.error = f"target '{target.name}': packaged artifact is inconsistent: " + "; ".join(problems)
    elif not (check.matches and shipped.matches):
        result.verified = False
        result.error = (
            f"target '{target.name}': output differs from ONNX Runtime's by up to "
            f"{max(check.max_abs_error, shipped.max_abs_error):.3g} (rtol {recipe.verify.rtol}, "
            f"atol {recipe.verify.atol}); the artifact in {artifact_dir} is not verified"
        )
    return result


def _describe_target(profile: DeviceProfile) -> str:
    spec = profile.target
    return ", ".join(f"{k}={v}" for k, v in spec.items() if k != "kind") or spec["kind"]


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


def _inputs_hash(recipe: Recipe, target: FleetTarget, profile: DeviceProfile, model: LoadedModel,
                 store: RecordStore) -> str:
    """Everything the artifact depends on: a change in any of these rebuilds it."""
    digest = hashlib.sha256()
    digest.update(json.dumps({
        "edgetune": edgetune.__version__,
        "model": model.sha256,
        "inputs": [list(i.shape) for i in model.inputs],
        # What the compiled code depends on; not hardware numbers such as a clock read off /proc.
        "tvm_target": str(profile.tvm_target()),
        "device": profile.device,
        "cross_compiler": profile.cross_compiler,
        "tuning": recipe.tuning.model_dump(mode="json"),
        "verify": recipe.verify.model_dump(mode="json"),
    }, sort_keys=True).encode())
    for path in store.files():
        digest.update(sha256_file(path).encode() if path.exists() else b"-")
    return digest.hexdigest()


def _reusable(artifact_dir: Path, archive: Path, inputs_hash: str) -> bool:
    if not (archive.is_file() and (artifact_dir / "manifest.json").is_file()):
        return False
    manifest = read_manifest(artifact_dir)
    return (
        manifest.get("build_inputs_sha256") == inputs_hash
        and manifest["verification"]["matches"]
        and not checksum_problems(artifact_dir, manifest)
    )


def _fill_from_manifest(result: TargetResult, manifest: dict, artifact_dir: Path, archive: Path) -> None:
    latency = manifest["latency_ms"]
    result.artifact = str(archive)
    result.artifact_dir = str(artifact_dir)
    result.latency_ms = latency["tuned"]
    result.untuned_latency_ms = latency["untuned"]
    result.reference_latency_ms = latency["onnxruntime"]
    result.verified = bool(manifest["verification"]["matches"])
    result.max_abs_error = manifest["verification"]["max_abs_error"]
