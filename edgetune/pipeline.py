"""build(recipe): every stage in order for each target of the fleet.

recipe -> model import -> tasks -> tuning -> compile -> package -> verify. Each target's
measurements live in its own record store, `<records_dir>/<target>-<digest of profile and TVM
target>/`, kept across builds; a target whose inputs (model, profile, tuning settings, records)
hash the same as its packaged artifact's is not compiled or packaged again. Targets tune after
their siblings (fleet[].transfer_from, or same ISA family and device), whose records warm-start them.
"""

from __future__ import annotations

import hashlib
import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import edgetune
from edgetune.archive import archive_directory
from edgetune.cuda_precompile import precompile_cuda
from edgetune.errors import BuildError, EdgetuneError, InputError
from edgetune.fleet.endpoints import RemoteDevice, device_summary, remote_device
from edgetune.fleet.tracker import require_servers
from edgetune.frontend.model import LoadedModel
from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
from edgetune.frontend.winograd import WinogradPolicy
from edgetune.package.artifact import claim_build_directory, sha256_file, write_artifact_files, write_manifest
from edgetune.package.deploy import build_program, missing_runner_hint, runner_for, stage_runtime
from edgetune.package.runtime import runtime_files
from edgetune.package.signing import Ed25519PrivateKey, load_private_key, sign_manifest, signature_matches
from edgetune.package.verify import OutputCheck, checksum_problems, read_manifest
from edgetune.profiles import DeviceProfile, resolve_profile
from edgetune.recipe import FleetTarget, Recipe, recipe_hash
from edgetune.reference import ReferenceRuntime
from edgetune.report import render_report
from edgetune.toolchains import Toolchain, check_toolchains
from edgetune.tuning.records import RecordStore
from edgetune.tuning.tasks import extract_tasks
from edgetune.tuning.transfer import load_sibling_records
from edgetune.tuning.tune import TaskProgress, TuningInterrupted, TuningPlan, TuningResult, tune

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
    verification: str = "not run"  # "matched", "mismatch", or "not run: <why>"
    max_abs_error: float | None = None
    trials_measured: int = 0
    trials_total: int = 0
    tuning_s: float = 0.0  # tuning wall time in this build
    kept_for_selection_s: float = 0.0  # of the tuning budget, left to comparing schedules inside the model
    tasks: list[dict[str, Any]] = field(default_factory=list)
    tasks_total: int = 0
    reused: bool = False  # inputs unchanged: the packaged artifact was kept
    records: str | None = None  # the target's record store: relative to the build directory, or absolute
    transfer: dict[str, Any] | None = None  # what its siblings' records contributed (None: no siblings)
    selection: dict[str, Any] | None = None  # schedules compared inside the model (None: not done)
    tuning_failed: list[str] = field(default_factory=list)  # "<task>: <ExcType>: <message>"; kept their best so far
    device: dict[str, Any] | None = None  # arch, via ("local"/"rpc"), emulated, key: fleet.endpoints.device_summary
    error: str | None = None
    wall_s: float = 0.0


@dataclass
class BuildResult:
    recipe: str
    output_dir: str
    targets: dict[str, TargetResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(t.error is None for t in self.targets.values())

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


def build(recipe: Recipe, only: list[str] | None = None, on_event: EventFn | None = None,
          records_dir: Path | None = None, sign_key: Path | None = None) -> BuildResult:
    """Build every target of the recipe (or those named in `only`), siblings first; one target's
    failure spares the rest. `records_dir` replaces the recipe's records_dir; `sign_key`: an Ed25519
    private key that signs each artifact's manifest (manifest.sig)."""
    emit = on_event or (lambda event: None)
    signer = load_private_key(sign_key) if sign_key is not None else None  # a bad key fails before any work
    profiles = {t.name: resolve_profile(t.profile, t.overrides) for t in recipe.fleet}
    order, siblings = order_fleet(recipe.fleet, profiles)
    selected = {t.name for t in _select(recipe, only)}
    targets = [t for t in order if t.name in selected]
    stores = record_stores(recipe, profiles, records_dir)
    result = BuildResult(recipe.name, str(recipe.output_dir / recipe.name))
    model = load_model(
        zoo=recipe.model.zoo, onnx_path=recipe.model_path, input_shapes=recipe.model.input_shapes,
        say=lambda message: emit(Event("model", message)), exported_program=recipe.exported_program_path,
    )
    toolchains = check_toolchains([profiles[t.name] for t in targets])
    relax_mod = to_relax(model)
    reference = ReferenceRuntime(model)
    claim_build_directory(Path(result.output_dir), [t.name for t in targets])  # refuses what is not edgetune's
    for target in targets:
        started = time.monotonic()
        try:
            profile = profiles[target.name]
            sibling_stores = {name: stores[name] for name in siblings[target.name] if stores[name].exists()}
            store = RecordStore(stores[target.name].directory)
            for warning in store.damage_warnings():
                emit(Event(target.name, f"warning: {warning}"))
            result.targets[target.name] = _build_target(
                recipe, target, profile, toolchains[profile.name], model, relax_mod, reference, emit,
                store, sibling_stores, signer,
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


def order_fleet(fleet: list[FleetTarget], profiles: dict[str, DeviceProfile]
                ) -> tuple[list[FleetTarget], dict[str, list[str]]]:
    """The fleet in tuning order (every target after its siblings) and each target's siblings.

    A target's siblings are its `transfer_from`, or when that is left out, the targets before it
    in that order with the same ISA family and device kind (same instructions, same kind of
    schedules). The recipe check has ruled out circles.
    """
    named = {t.name: t for t in fleet}
    order: list[FleetTarget] = []
    placed: set[str] = set()

    def place(target: FleetTarget) -> None:
        if target.name in placed:
            return
        placed.add(target.name)
        for source in target.transfer_from or []:
            place(named[source])
        order.append(target)

    for target in fleet:
        place(target)
    siblings: dict[str, list[str]] = {}
    for position, target in enumerate(order):
        if target.transfer_from is not None:
            siblings[target.name] = list(target.transfer_from)
            continue
        family = (profiles[target.name].isa, profiles[target.name].device)
        siblings[target.name] = [t.name for t in order[:position]
                                 if (profiles[t.name].isa, profiles[t.name].device) == family]
    return order, siblings


@dataclass(frozen=True)
class StoreLocation:
    """Where one target's records live; opened only when the target is built or read as a sibling."""

    directory: Path

    def exists(self) -> bool:
        return (self.directory / "database_tuning_record.json").is_file()


def record_stores(recipe: Recipe, profiles: dict[str, DeviceProfile],
                  records_dir: Path | None = None) -> dict[str, StoreLocation]:
    """Each fleet target's store: named after the target and a digest of its profile and TVM target,
    because TVM's database ignores the target when queried (a shared store would hand one device
    another's schedules), and a changed profile must not inherit records measured for the old one."""
    root = Path(records_dir).resolve() if records_dir is not None else recipe.records_path
    locations = {}
    for target in recipe.fleet:
        profile = profiles[target.name]
        digest = hashlib.sha256(json.dumps(
            {"profile": profile.name, "device": profile.device, "target": str(profile.tvm_target())},
            sort_keys=True).encode()).hexdigest()[:10]
        locations[target.name] = StoreLocation(root / f"{target.name}-{digest}")
    return locations


def record_locations(recipe: Recipe, only: list[str] | None = None,
                     records_dir: Path | None = None) -> dict[str, StoreLocation]:
    """The stores of the recipe's targets (or those named in `only`), for export and import."""
    profiles = {t.name: resolve_profile(t.profile, t.overrides) for t in recipe.fleet}
    stores = record_stores(recipe, profiles, records_dir)
    return {t.name: stores[t.name] for t in _select(recipe, only)}


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
    toolchain: Toolchain,
    model: LoadedModel,
    relax_mod,
    reference: ReferenceRuntime,
    emit: EventFn,
    store: RecordStore,
    sibling_stores: dict[str, StoreLocation],
    signer: Ed25519PrivateKey | None = None,
) -> TargetResult:
    # Measured here: this machine's CPU. Other devices need an RPC connection, or no tuning at all.
    measured_here = target.is_local and profile.device == "cpu" and toolchain.native
    remote = remote_device(recipe, target, profile.device, toolchain.cc)
    if remote is not None:
        require_servers(remote.tracker, remote.key)  # a missing device is named before any work
    if not measured_here and remote is None and recipe.tuning.trials_per_task != 0:
        raise BuildError(
            f"target '{target.name}': a {toolchain.arch}/{profile.device} device cannot be measured on this "
            "machine; give it an RPC connection, or set tuning.trials_per_task: 0 to compile it with the "
            "records its store already holds"
        )
    tvm_target = profile.tvm_target()
    winograd = winograd_policy(recipe, profile)
    root = recipe.output_dir / recipe.name
    work = root / "work" / target.name
    candidates = recipe.tuning.in_model_candidates if measured_here else 1
    budget_s = recipe.tuning.time_budget_min * 60 if recipe.tuning.time_budget_min else None
    keep_for_selection = None
    if candidates > 1 and budget_s is not None:
        keep_for_selection = partial(_selection_reserve, relax_mod, tvm_target, store, model, profile, candidates,
                                     winograd, budget_s, lambda message: emit(Event(target.name, message)))
    result = _tune_target(recipe, target, profile, tvm_target, relax_mod, store, emit, remote, sibling_stores, work,
                          winograd, budget_s, keep_for_selection)
    # the budget runs on the tuner's clock, which starts after task extraction
    budget_ends = time.monotonic() - result.tuning_s + budget_s if budget_s is not None else None

    artifact_dir = root / target.name
    archive = root / f"{target.name}.tar.gz"
    inputs_hash = _inputs_hash(recipe, target, profile, toolchain, model, store)
    if _reusable(artifact_dir, archive, inputs_hash):
        emit(Event(target.name, "inputs unchanged: keeping the packaged artifact"))
        if signer is not None and not signature_matches(artifact_dir, signer.public_key()):
            sign_manifest(artifact_dir, signer)
            archive_directory(artifact_dir, archive)
        _fill_from_manifest(result, read_manifest(artifact_dir), artifact_dir, archive)
        result.reused = True
        return result

    from edgetune.compile import compile_model, export_library

    work.mkdir(parents=True, exist_ok=True)
    samples = model.sample_inputs()
    database = store.database
    if candidates > 1:
        emit(Event(target.name, f"timing each kernel's {candidates} best schedules inside the model"))
        database = _select_in_model(result, relax_mod, tvm_target, store, model, samples, profile, candidates,
                                    winograd, budget_ends)
    emit(Event(target.name, f"compiling with the tuned records ({toolchain.cc.name})"))
    executable = compile_model(relax_mod, tvm_target, database, winograd)
    cuda_kernels = _precompile_kernels(executable, profile, toolchain)
    library = export_library(executable, work / "model.so", toolchain.fcompile())
    expected = reference.run(samples)
    latency = {"tuned": None, "untuned": None, "onnxruntime": None}
    measured_on = _measured_on(profile) if measured_here else remote.where if remote else None
    if measured_here:
        emit(Event(target.name, "timing tuned, untuned and ONNX Runtime"))
        latency = _measure(relax_mod, tvm_target, library, model, samples, reference, profile, work,
                           winograd)
    elif remote is not None:
        emit(Event(target.name, f"timing tuned and untuned on the device ({remote.where})"))
        latency = _measure_remote(relax_mod, tvm_target, library, model, samples, toolchain, remote, work,
                                  winograd)

    context = _template_context(recipe, target, profile, toolchain, model, latency, measured_on)
    write_artifact_files(artifact_dir, library=library, sample_inputs=samples, reference_outputs=expected,
                         template_context=context)
    runtime_dir = None
    if recipe.package.bundle_runtime:
        emit(Event(target.name, f"bundling TVM's {toolchain.arch} runtime and building the C++ deploy program"))
        runtime_dir = stage_runtime(runtime_files(toolchain.arch), artifact_dir / "runtime")
        build_program(artifact_dir / "deploy", toolchain, runtime_dir, artifact_dir / "bin" / "deploy")
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
            "isa": profile.isa,
            "arch": toolchain.arch,
            "tvm_target": json.loads(json.dumps(profile.target)),
            "tvm_host": json.loads(json.dumps(profile.host)),
        },
        "versions": _versions(),
        "toolchain": toolchain.describe(),
        "cuda_kernels": cuda_kernels,
        "runtime_bundled": runtime_dir is not None,
        "tuning": {
            "search": recipe.tuning.search,
            "trials_per_task": recipe.tuning.trials_per_task,
            "time_budget_min": recipe.tuning.time_budget_min,
            "seed": recipe.tuning.seed,
            "winograd": recipe.tuning.winograd,
            "tasks_total": result.tasks_total,
            "trials_total": result.trials_total,
            "tasks": result.tasks,
        },
        "latency_ms": latency,
        "measured_on": measured_on,
        "verification": {"reference": reference.name, "rtol": recipe.verify.rtol, "atol": recipe.verify.atol},
    }
    emit(Event(target.name, "verifying the packaged artifact against ONNX Runtime"))
    manifest["verification"].update(_verify_shipped(artifact_dir, manifest, toolchain, runtime_dir, remote))
    write_manifest(artifact_dir, manifest)
    if signer is not None:
        sign_manifest(artifact_dir, signer)
    archive_directory(artifact_dir, archive)
    _fill_from_manifest(result, read_manifest(artifact_dir), artifact_dir, archive)
    result.device = device_summary(toolchain.arch, remote)
    problems = checksum_problems(artifact_dir, read_manifest(artifact_dir))
    verification = manifest["verification"]
    if problems:
        result.error = f"target '{target.name}': packaged artifact is inconsistent: " + "; ".join(problems)
    elif verification["matches"] is False:
        result.error = (
            f"target '{target.name}': output differs from ONNX Runtime's by up to "
            f"{verification['max_abs_error']:.3g} (rtol {recipe.verify.rtol}, atol {recipe.verify.atol}); "
            f"the artifact in {artifact_dir} is not verified"
        )
    return result


def _tune_target(recipe, target, profile, tvm_target, relax_mod, store, emit, remote, sibling_stores,
                 work, winograd: WinogradPolicy | None, budget_s: float | None,
                 keep_for_selection: Callable[[], float] | None) -> TargetResult:
    emit(Event(target.name, f"extracting tasks for {profile.name} ({_describe_target(profile)})"))
    tasks = extract_tasks(fuse_for_tuning(relax_mod, tvm_target, winograd), tvm_target)
    tuned_tasks = tasks[: recipe.tuning.max_tasks] if recipe.tuning.max_tasks else tasks
    trials = recipe.tuning.trials_per_task
    siblings = None
    if sibling_stores and recipe.tuning.transfer != "off" and trials != 0:
        siblings = load_sibling_records({n: RecordStore(s.directory) for n, s in sibling_stores.items()},
                                        tuned_tasks, tvm_target, profile.hardware.cores or 1)
        emit(Event(target.name, f"transfer from {', '.join(sibling_stores)}: {siblings.records_used} of their "
                                f"records, {sum(map(len, siblings.seeds.values()))} schedules to re-measure first"))
    plan = TuningPlan(
        trials_per_task=1_000_000 if trials is None else trials,
        time_budget_s=budget_s,
        search=recipe.tuning.search,
        seed=recipe.tuning.seed,
        cores=profile.hardware.cores or 1,
        hardware=profile.hardware,
        device=profile.device,
        isa=profile.isa,
        remote=remote,
        siblings=siblings,
        transfer=recipe.tuning.transfer,
        keep_for_later=keep_for_selection,
    )
    if trials == 0:
        emit(Event(target.name, f"{len(tasks)} tasks; no tuning (trials_per_task: 0)"))
    else:
        where = f", measured on {remote.where}" if remote else ""
        emit(Event(target.name, f"{len(tasks)} tasks, tuning {len(tuned_tasks)} with {plan.search} search{where}"))
    tuning = tune(tuned_tasks, tvm_target, store, plan, lambda p: emit(Event(target.name, "", p)),
                  logs_dir=work / "logs")
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
            "space_exhausted": t.space_exhausted,
            "candidates": asdict(t.search) if recipe.tuning.search == "draft-verify" else None,
            "search_fallback": t.search.fallback,
            "tuning_failed": t.tuning_failed,
        }
        for t in tuning.tasks
    ]
    for t in tuning.failed:
        kept = "its best schedule so far" if t.best_us is not None else "its untuned schedule"
        emit(Event(target.name, f"warning: tuning of task {t.name} failed ({t.tuning_failed}); it keeps {kept}"))
    return TargetResult(
        target.name,
        trials_measured=tuning.trials_measured,
        trials_total=sum(t["trials"] for t in summary),
        tuning_s=tuning.wall_s,
        kept_for_selection_s=tuning.kept_s,
        tasks=summary,
        tasks_total=len(tasks),
        records=_display_store(store.directory, recipe.output_dir / recipe.name),
        transfer=_transfer_summary(tuning, sibling_stores, recipe.tuning.transfer),
        tuning_failed=[f"{t.name}: {t.tuning_failed}" for t in tuning.failed],
    )


def winograd_policy(recipe: Recipe, profile: DeviceProfile) -> WinogradPolicy | None:
    """The device's Winograd choices (tuning.winograd), from its profile's peak and bandwidth."""
    if not recipe.tuning.winograd:
        return None
    return WinogradPolicy(profile.hardware.peak_gflops, profile.hardware.memory_bandwidth_gbs)


def _display_store(directory: Path, build_dir: Path) -> str:
    """The store's path relative to the build directory when inside it, so a moved build still finds it."""
    return str(directory.relative_to(build_dir)) if directory.is_relative_to(build_dir) else str(directory)


def _transfer_summary(tuning: TuningResult, sibling_stores: dict, mode: str) -> dict[str, Any] | None:
    """Which siblings' records were used and what came of them, per target."""
    if not sibling_stores:
        return None
    stats = tuning.transfer
    if stats is None:
        why = "transfer: off" if mode == "off" else "no tuning in this build, or no sibling records of these tasks"
        return {"sources": list(sibling_stores), "used": False, "why_not": why}
    best = {t.name: t.best_us for t in tuning.tasks}
    return {
        "sources": stats.sources,
        "used": True,
        "mode": stats.mode,
        "sibling_records": stats.sibling_records,
        "seeds_measured": stats.seeds_measured,
        "tasks_best_from_sibling": sorted(
            name for name, seconds in stats.seed_best.items()
            if best.get(name) is not None and seconds * 1e6 <= best[name] * (1 + 1e-9)
        ),
        "guard_fell_back": sorted(stats.distrusted),
    }


def _select_in_model(result: TargetResult, relax_mod, tvm_target, store: RecordStore, model: LoadedModel,
                     samples: dict[str, np.ndarray], profile: DeviceProfile, candidates: int,
                     winograd: WinogradPolicy | None, deadline: float | None):
    """The database to compile with: each kernel's fastest in the model of its tuned best few (edgetune/selection.py).

    Fills the result's `selection` summary and each task's `in_model_rank` (0: the tuner's best).
    """
    import tvm

    from edgetune.runtime import use_cpu_threads
    from edgetune.selection import select_schedules

    if profile.cpu_threads:
        use_cpu_threads(profile.cpu_threads)  # the threads the model is timed and shipped with
    selection = select_schedules(relax_mod, tvm_target, store.database, [samples[i.name] for i in model.inputs],
                                 tvm.device(profile.device, 0), candidates, winograd, deadline=deadline)
    for task in result.tasks:
        choice = selection.choices.get(task["name"])
        task["in_model_rank"] = choice.rank if choice else None
    result.selection = {
        "candidates": candidates,
        "models_compiled": selection.models_compiled,
        "seconds": selection.seconds,
        "kernels_changed": sorted(name for name, c in selection.choices.items() if c.rank > 0),
        "in_model_us": selection.in_model_us,
        "tuner_best_in_model_us": selection.tuner_best_in_model_us,
        "stopped_by_budget": selection.stopped_by_deadline,
    }
    return selection.database


def _selection_reserve(relax_mod, tvm_target, store: RecordStore, model: LoadedModel, profile: DeviceProfile,
                       candidates: int, winograd: WinogradPolicy | None, budget_s: float,
                       say: Callable[[str], None]) -> float:
    """Seconds of the tuning budget to keep for `_select_in_model`: one compile and run of the model with the
    tuner's best so far, measured now, per candidate rank (at most half the budget)."""
    import tvm

    from edgetune.selection import rank_seconds

    samples = model.sample_inputs()
    one_rank = rank_seconds(relax_mod, tvm_target, store.database, [samples[i.name] for i in model.inputs],
                            tvm.device(profile.device, 0), winograd)
    kept = min(candidates * one_rank, budget_s / 2)
    say(f"one compile and run of the model took {one_rank:.0f} s: the tuning budget keeps {kept:.0f} s for "
        f"comparing each kernel's {candidates} best schedules inside the model")
    return kept


def _measure(relax_mod, tvm_target, library, model, samples, reference, profile, work,
             winograd: WinogradPolicy | None) -> dict[str, float]:
    """Latency of the packaged library, of the same model untuned, and of ONNX Runtime, on this machine."""
    import tvm

    from edgetune.compile import compile_model, export_library
    from edgetune.runtime import load_library, time_model, use_cpu_threads

    device = tvm.device(profile.device, 0)
    sample_list = [samples[i.name] for i in model.inputs]
    untuned = export_library(compile_model(relax_mod, tvm_target, None, winograd), work / "untuned.so")
    if profile.cpu_threads:
        use_cpu_threads(profile.cpu_threads)  # as many as ONNX Runtime is given
    return {
        "tuned": time_model(load_library(library, device), sample_list, device),
        "untuned": time_model(load_library(untuned, device), sample_list, device),
        "onnxruntime": reference.time(samples, threads=profile.hardware.cores or 1),
    }


def _measure_remote(relax_mod, tvm_target, library, model, samples, toolchain, remote, work,
                    winograd: WinogradPolicy | None) -> dict[str, float | None]:
    """Latency of the packaged library and of the same model untuned, timed on the device over RPC.

    ONNX Runtime runs on this machine only, so the device has no reference latency.
    """
    from edgetune.compile import compile_model, export_library
    from edgetune.fleet.session import remote_latency_ms

    sample_list = [samples[i.name] for i in model.inputs]
    untuned = export_library(compile_model(relax_mod, tvm_target, None, winograd), work / "untuned.so",
                             toolchain.fcompile())
    return {
        "tuned": remote_latency_ms(remote, library, sample_list),
        "untuned": remote_latency_ms(remote, untuned, sample_list),
        "onnxruntime": None,
    }


def _verify_shipped(artifact_dir: Path, manifest: dict, toolchain: Toolchain, runtime_dir: Path | None,
                    remote: RemoteDevice | None) -> dict:
    """Run what ships, loaded afresh from the artifact, on the sample input; say how, or why not."""
    from edgetune.package.verify import check_native_outputs

    checks: list[tuple[str, OutputCheck]] = []
    reasons = []
    if manifest["target"]["device"] != "cpu":
        reasons.append(f"no {manifest['target']['device']} device on this machine")
    else:
        if toolchain.native:
            checks.append(("TVM's Python runtime, this machine", check_native_outputs(artifact_dir, manifest)))
        program_runner = runner_for(toolchain.arch)
        if program_runner is None:
            reasons.append(missing_runner_hint(toolchain.arch))
        elif runtime_dir is not None or not toolchain.native:
            method = "C++ deploy program" + (f" under {program_runner[0]}" if program_runner else ", this machine")
            checks.append((method, _check_program(artifact_dir, manifest, toolchain, runtime_dir)))
    if remote is not None:
        from edgetune.package.verify import check_remote_outputs

        check = check_remote_outputs(artifact_dir, manifest, remote)
        checks.append((f"TVM's runtime on the device, {remote.where}", check))
    if not checks:
        return {"matches": None, "max_abs_error": None, "methods": [], "not_run": "; ".join(reasons)}
    return {
        "matches": all(c.matches for _, c in checks),
        "max_abs_error": max(c.max_abs_error for _, c in checks),
        "methods": [m for m, _ in checks],
        "not_run": None,
    }


def _check_program(artifact_dir: Path, manifest: dict, toolchain: Toolchain, runtime_dir: Path | None):
    """The deploy program: the artifact's own build when bundled, else one built here from its sources."""
    from edgetune.package.verify import check_program_outputs

    if runtime_dir is not None:
        return check_program_outputs(artifact_dir, manifest, artifact_dir / "bin" / "deploy", runtime_dir / "lib")
    with tempfile.TemporaryDirectory() as scratch:
        staged = stage_runtime(runtime_files(toolchain.arch), Path(scratch) / "runtime")
        program = build_program(artifact_dir / "deploy", toolchain, staged, Path(scratch) / "deploy")
        return check_program_outputs(artifact_dir, manifest, program, staged / "lib")


def _template_context(recipe, target, profile, toolchain, model, latency, measured_on) -> dict[str, Any]:
    """What the artifact's io.json and templates are made from. Names stay strings here: the README
    escapes every value it prints, the code templates refuse any but numbers and plain words."""
    import tvm

    def ms(value: float | None) -> str:
        return f"{value:.3f} ms" if value is not None else "not measured"

    return {
        "model_name": model.name,
        "target_name": target.name,
        "recipe_name": recipe.name,
        "recipe_hash": recipe_hash(recipe),
        "profile": profile.name,
        "tvm_target": json.dumps(profile.target, sort_keys=True),
        "device": profile.device,
        "cpu_threads": profile.cpu_threads,
        "arch": toolchain.arch,
        "cxx": toolchain.cxx.name if toolchain.cxx else "g++",
        "edgetune_version": edgetune.__version__,
        "tvm_package": f"apache-tvm=={tvm.__version__}",
        "output_names": list(model.output_names),
        "inputs": [
            {"name": i.name, "shape": [int(d) for d in i.shape], "dl_code": _DL_CODES[np.dtype(i.dtype).kind],
             "bits": np.dtype(i.dtype).itemsize * 8}
            for i in model.inputs
        ],
        "rtol": recipe.verify.rtol,
        "atol": recipe.verify.atol,
        "measured_on": measured_on if latency["tuned"] is not None else "no device (not measured)",
        "tuned_text": ms(latency["tuned"]),
        "untuned_text": ms(latency["untuned"]),
        "reference_text": ms(latency["onnxruntime"]),
    }


_DL_CODES = {"f": "kDLFloat", "i": "kDLInt", "u": "kDLUInt", "b": "kDLBool"}
"""DLPack's type code per numpy dtype kind, for the deploy program's input tensors."""


def _measured_on(profile: DeviceProfile) -> str:
    return f"this build machine ({platform.machine()}, {profile.hardware.cores} cores)"


def _precompile_kernels(executable, profile: DeviceProfile, toolchain: Toolchain) -> str | None:
    """For CUDA targets, embed nvcc's fatbin when a toolkit is here; say which form the kernels ship in."""
    if profile.device != "cuda":
        return None
    if toolchain.cuda is None:
        return "CUDA C source, compiled by NVRTC when the library loads on the device (no nvcc found here)"
    arch = profile.target["arch"]
    form = precompile_cuda(executable, arch, toolchain.cuda.nvcc)
    return f"{form} for {arch}, precompiled with nvcc {toolchain.cuda.version}"


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


def _inputs_hash(recipe: Recipe, target: FleetTarget, profile: DeviceProfile, toolchain: Toolchain,
                 model: LoadedModel, store: RecordStore) -> str:
    """Everything the artifact depends on: a change in any of these rebuilds it."""
    digest = hashlib.sha256()
    digest.update(json.dumps({
        "edgetune": edgetune.__version__,
        "model": model.sha256,
        "inputs": [list(i.shape) for i in model.inputs],
        # What the compiled code depends on; not hardware numbers such as a clock read off /proc.
        "tvm_target": str(profile.tvm_target()),
        "device": profile.device,
        "toolchain": toolchain.describe(),
        "tuning": recipe.tuning.model_dump(mode="json"),
        "verify": recipe.verify.model_dump(mode="json"),
        "package": recipe.package.model_dump(mode="json"),
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
        and manifest["verification"]["matches"] is not False
        and not checksum_problems(artifact_dir, manifest)
    )


def _fill_from_manifest(result: TargetResult, manifest: dict, artifact_dir: Path, archive: Path) -> None:
    latency = manifest["latency_ms"]
    result.artifact = str(archive)
    result.artifact_dir = str(artifact_dir)
    result.latency_ms = latency["tuned"]
    result.untuned_latency_ms = latency["untuned"]
    result.reference_latency_ms = latency["onnxruntime"]
    verification = manifest["verification"]
    result.verified = verification["matches"] is True
    result.verification = (
        "matched" if verification["matches"] else "mismatch" if verification["matches"] is False
        else f"not run: {verification['not_run']}"
    )
    result.max_abs_error = verification["max_abs_error"]
