"""Stage: verify. Run what ships, loaded afresh from the artifact, on the sample input (here, under
qemu, or on the device over RPC) and compare with the reference; then the manifest is written, signed
and archived, and the target's result says whether the artifact can be trusted."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from edgetune.archive import archive_directory
from edgetune.build.context import TargetBuild
from edgetune.report.summary import TargetResult
from edgetune.build.package import PackagedTarget
from edgetune.package.artifact import replace_owned_directory, write_manifest
from edgetune.package.deploy import build_program, missing_runner_hint, runner_for, stage_runtime
from edgetune.package.manifest import Manifest, Verification
from edgetune.package.runtime import runtime_files
from edgetune.package.signing import sign_manifest
from edgetune.package.verify import OutputCheck, checksum_problems, load_manifest


def verify_stage(ctx: TargetBuild, result: TargetResult, packaged: PackagedTarget) -> None:
    """Complete the staged artifact's manifest with the verification, sign it, put the artifact in place and
    archive it; fill `result` (an error when the output differs or the artifact is inconsistent)."""
    reference = ctx.reference.display_name
    ctx.say(f"verifying the packaged artifact against {reference}")
    manifest = packaged.manifest
    try:
        verified = {**manifest.verification.model_dump(exclude_unset=True), **_verify_shipped(ctx, packaged)}
        verification = Verification(**verified)
        write_manifest(packaged.directory, manifest.model_copy(update={"verification": verification}))
        if ctx.signer is not None:
            sign_manifest(packaged.directory, ctx.signer)
        replace_owned_directory(packaged.directory, ctx.artifact_dir)
    except BaseException:
        shutil.rmtree(packaged.directory, ignore_errors=True)
        raise
    archive_directory(ctx.artifact_dir, ctx.archive)
    written = load_manifest(ctx.artifact_dir)
    fill_from_manifest(result, written, ctx.artifact_dir, ctx.archive)
    problems = checksum_problems(ctx.artifact_dir, written)
    if problems:
        result.error = f"target '{ctx.name}': packaged artifact is inconsistent: " + "; ".join(problems)
    elif verification.matches is False:
        result.error = (
            f"target '{ctx.name}': output differs from {reference}'s by up to "
            f"{verification.max_abs_error:.3g} (rtol {ctx.recipe.verify.rtol}, atol {ctx.recipe.verify.atol}); "
            f"the artifact in {ctx.artifact_dir} is not verified"
        )


def fill_from_manifest(result: TargetResult, manifest: Manifest, artifact_dir: Path, archive: Path) -> None:
    """The result's artifact, latency and verification fields, as the (new or kept) manifest states them."""
    latency = manifest.latency_ms
    result.artifact = str(archive)
    result.artifact_dir = str(artifact_dir)
    result.latency_ms = latency.tuned
    result.untuned_latency_ms = latency.untuned
    result.reference_latency_ms = latency.onnxruntime
    result.thread_wait = manifest.thread_wait.model_dump() if manifest.thread_wait else None
    verification = manifest.verification
    result.verified = verification.matches is True
    result.verification = (
        "matched" if verification.matches else "mismatch" if verification.matches is False
        else f"not run: {verification.not_run}"
    )
    result.max_abs_error = verification.max_abs_error


def _verify_shipped(ctx: TargetBuild, packaged: PackagedTarget) -> dict:
    """Each way this machine (and the device, over RPC) can run the artifact; say how, or why not."""
    from edgetune.package.verify import check_native_outputs

    artifact_dir, manifest, toolchain = packaged.directory, packaged.manifest, ctx.toolchain
    checks: list[tuple[str, OutputCheck]] = []
    reasons = []
    if manifest.target.device != "cpu":
        reasons.append(f"no {manifest.target.device} device on this machine")
    else:
        if toolchain.native:
            checks.append(("TVM's Python runtime, this machine", check_native_outputs(artifact_dir, manifest)))
        program_runner = runner_for(toolchain.arch)
        if program_runner is None:
            reasons.append(missing_runner_hint(toolchain.arch))
        elif packaged.runtime_dir is not None or not toolchain.native:
            method = "C++ deploy program" + (f" under {program_runner[0]}" if program_runner else ", this machine")
            checks.append((method, _check_program(ctx, packaged)))
    on_device = ctx.device.output_check(artifact_dir, manifest)
    if on_device is not None:
        checks.append(on_device)
    if not checks:
        return {"matches": None, "max_abs_error": None, "methods": [], "not_run": "; ".join(reasons)}
    return {
        "matches": all(c.matches for _, c in checks),
        "max_abs_error": max(c.max_abs_error for _, c in checks),
        "methods": [m for m, _ in checks],
        "not_run": None,
    }


def _check_program(ctx: TargetBuild, packaged: PackagedTarget) -> OutputCheck:
    """The deploy program: the artifact's own build when bundled, else one built here from its sources."""
    from edgetune.package.verify import check_program_outputs

    artifact_dir, manifest, runtime_dir = packaged.directory, packaged.manifest, packaged.runtime_dir
    if runtime_dir is not None:
        return check_program_outputs(artifact_dir, manifest, artifact_dir / "bin" / "deploy", runtime_dir / "lib")
    with tempfile.TemporaryDirectory() as scratch:
        staged = stage_runtime(runtime_files(ctx.toolchain.arch), Path(scratch) / "runtime")
        program = build_program(artifact_dir / "deploy", ctx.toolchain, staged, Path(scratch) / "deploy")
        return check_program_outputs(artifact_dir, manifest, program, staged / "lib")
