"""build(recipe): every stage in order for each target of the fleet.

recipe -> model import (once per recipe) -> per target, a TargetBuild context (edgetune/build/context.py)
-> tune -> compile -> measure -> package -> verify (edgetune/build/, one module per stage) -> summary
and report. Each target's measurements live in its own record store, `<records_dir>/<target>-<digest of
profile and TVM target>/`, kept across builds; a target whose inputs (model, profile, tuning settings,
records) hash the same as its packaged artifact's is not compiled or packaged again. Targets tune after
their siblings (fleet[].transfer_from, or same ISA family and device), whose records warm-start them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import edgetune
from edgetune.archive import archive_directory
from edgetune.build.compile import compile_stage
from edgetune.build.context import Event, EventFn, StoreLocation, TargetBuild
from edgetune.build.measure import measure_stage
from edgetune.build.package import package_stage
from edgetune.build.tune import tune_stage
from edgetune.build.verify import fill_from_manifest, verify_stage
from edgetune.devices import open_device
from edgetune.errors import EdgetuneError, InputError
from edgetune.fleet.endpoints import remote_device
from edgetune.frontend.onnx import load_model, to_relax
from edgetune.ownership import write_atomically
from edgetune.package.artifact import claim_build_directory, sha256_file
from edgetune.package.signing import load_private_key, sign_manifest, signature_matches
from edgetune.package.verify import checksum_problems, load_manifest
from edgetune.profiles import DeviceProfile, resolve_profile
from edgetune.recipe import FleetTarget, Recipe
from edgetune.reference import ReferenceRuntime
from edgetune.report import render_report
from edgetune.report.summary import SUMMARY_NAME, BuildResult, TargetResult
from edgetune.runtime import release_freed_memory
from edgetune.toolchains import check_toolchains
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.shards import ShardPool
from edgetune.tuning.tune import TuningInterrupted

T = TypeVar("T")


def build(recipe: Recipe, only: list[str] | None = None, on_event: EventFn | None = None,
          records_dir: Path | None = None, sign_key: Path | None = None, task_pool: ShardPool | None = None,
          write_summary: bool = True, started: float | None = None) -> BuildResult:
    """Build every target of the recipe (or those named in `only`), siblings first; one target's
    failure spares the rest. `records_dir` replaces the recipe's records_dir; `sign_key`: an Ed25519
    private key that signs each artifact's manifest (manifest.sig); `task_pool`: workers that tune shards
    of a target's tasks; `write_summary`: False for one unit of a release, whose summary.json and report
    cover all the recipe's targets and are written once they are all built (edgetune.release); `started`:
    when the command began (`time.monotonic()`), so that the first target's budget covers its import of TVM
    too (6 s on a busy machine), not only the model's."""
    build_started = started if started is not None else time.monotonic()
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
    model = model.without_graph()
    release_freed_memory()
    claim_build_directory(Path(result.output_dir), [t.name for t in targets])  # refuses what is not edgetune's
    for position, target in enumerate(targets):
        started = time.monotonic() if position else build_started  # the first target's budget covers the import
        try:
            profile = profiles[target.name]
            sibling_stores = {name: stores[name] for name in siblings[target.name] if stores[name].exists()}
            store = RecordStore(stores[target.name].directory)
            for warning in store.damage_warnings():
                emit(Event(target.name, f"warning: {warning}"))
            toolchain = toolchains[profile.name]
            remote = remote_device(recipe, target, profile.device, toolchain.cc)
            device = open_device(target, profile, toolchain, remote)
            ctx = TargetBuild(recipe, target, profile, toolchain, model, relax_mod, reference, store,
                              sibling_stores, device, emit, signer, task_pool, started)
            try:
                result.targets[target.name] = _build_target(ctx)
            finally:
                ctx.untuned.close()  # a failed or stopped target does not wait for its untuned compile
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
    if write_summary:
        write_summary_and_report(result)
    return result


def write_summary_and_report(result: BuildResult) -> None:
    """summary.json (replaced atomically: a release's reader never sees half of one) and report.html."""
    summary_path = Path(result.output_dir) / SUMMARY_NAME
    write_atomically(summary_path, json.dumps(result.to_json(), indent=2) + "\n")
    render_report(summary_path.parent)


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


def _build_target(ctx: TargetBuild) -> TargetResult:
    """The stages in order for one target; a target whose inputs are unchanged keeps its artifact. Each stage's
    seconds go into the result's `stage_s`, so a reader sees where the budget went."""
    stages = {"import": time.monotonic() - ctx.started}  # the model's import, for the recipe's first target

    def timed(name: str, stage: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return stage()
        finally:
            stages[name] = time.monotonic() - start
            release_freed_memory()

    _check_device(ctx)
    result = timed("tune", lambda: tune_stage(ctx))
    result.stage_s = stages
    result.device = ctx.device.summary()
    # the in-model comparison ends early enough for the stages after it to end within the budget
    budget_ends = ctx.budget_ends - ctx.finish_reserve_s if ctx.budget_ends is not None else None
    inputs_hash = _inputs_hash(ctx)
    if _reusable(ctx.artifact_dir, ctx.archive, inputs_hash):
        ctx.say("inputs unchanged: keeping the packaged artifact")
        if ctx.signer is not None and not signature_matches(ctx.artifact_dir, ctx.signer.public_key()):
            sign_manifest(ctx.artifact_dir, ctx.signer)
            archive_directory(ctx.artifact_dir, ctx.archive)
        fill_from_manifest(result, load_manifest(ctx.artifact_dir), ctx.artifact_dir, ctx.archive)
        result.reused = True
        result.anchor_tuning_curve()
        return result
    compiled = timed("compile", lambda: compile_stage(ctx, result, budget_ends))
    latency = timed("measure", lambda: measure_stage(ctx, compiled.library, compiled.samples,
                                                               compiled.thread_pool))
    packaged = timed("package", lambda: package_stage(ctx, result, compiled, latency, inputs_hash))
    timed("verify", lambda: verify_stage(ctx, result, packaged))
    ctx.say("seconds per stage: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in stages.items()))
    result.anchor_tuning_curve()
    return result


def _check_device(ctx: TargetBuild) -> None:
    """Measured here: this machine's CPU. Other devices need an RPC connection, or no tuning at all; a
    missing device is named before any work."""
    ctx.device.check_reachable(ctx.recipe.tuning.trials_per_task)


def _inputs_hash(ctx: TargetBuild) -> str:
    """Everything the artifact depends on: a change in any of these rebuilds it."""
    recipe, model, profile = ctx.recipe, ctx.model, ctx.profile
    digest = hashlib.sha256()
    digest.update(json.dumps({
        "edgetune": edgetune.__version__,
        "model": model.sha256,
        "inputs": [list(i.shape) for i in model.inputs],
        # What the compiled code depends on; not hardware numbers such as a clock read off /proc.
        "tvm_target": str(profile.tvm_target()),
        "device": profile.device,
        "toolchain": ctx.toolchain.describe(),
        "tuning": recipe.tuning.model_dump(mode="json"),
        "verify": recipe.verify.model_dump(mode="json"),
        "package": recipe.package.model_dump(mode="json"),
    }, sort_keys=True).encode())
    for path in ctx.store.files():
        digest.update(sha256_file(path).encode() if path.exists() else b"-")
    return digest.hexdigest()


def _reusable(artifact_dir: Path, archive: Path, inputs_hash: str) -> bool:
    if not (archive.is_file() and (artifact_dir / "manifest.json").is_file()):
        return False
    try:
        manifest = load_manifest(artifact_dir)
    except InputError:  # damaged, or an edgetune that wrote other fields: built afresh
        return False
    return (
        manifest.build_inputs_sha256 == inputs_hash
        and manifest.verification.matches is not False
        and not checksum_problems(artifact_dir, manifest)
    )
