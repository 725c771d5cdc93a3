"""Check an artifact before it ships: its manifest, every checksum, its signature when a key is
trusted, then its output against ONNX Runtime's.

An artifact may come from anywhere, so nothing of it is loaded until the manifest, the checksums
and the signature are checked, and even then its library runs in a child process: verifying runs
the artifact's code, and that code gets no hold on the verifier's memory.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np

from edgetune.errors import BuildError, InputError
from edgetune.fleet.endpoints import RemoteDevice
from edgetune.package.artifact import (
    LIBRARY_NAME,
    MANIFEST_NAME,
    REFERENCE_OUTPUT_NAME,
    SAMPLE_INPUT_NAME,
    artifact_files,
    save_arrays,
    sha256_file,
)
from edgetune.package.manifest import Manifest, parse_manifest
from edgetune.thread_pool import POOL_LIBRARY_NAME

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class OutputCheck:
    matches: bool
    max_abs_error: float


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest's JSON object, its fields not yet checked; InputError when it is missing, not JSON or not
    an object. `load_manifest` checks the fields."""
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InputError(f"{directory}: no {MANIFEST_NAME}; not an edgetune artifact") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot be read as text: {exc}") from exc
    if not isinstance(manifest, dict):
        raise InputError(f"{path}: expected a JSON object, found a {type(manifest).__name__}")
    return manifest


def load_manifest(directory: Path) -> Manifest:
    """The artifact's manifest, every field checked: InputError with one located message per field that is
    missing, of the wrong type, too long, not a sha256, or a listed path that leaves the artifact."""
    return parse_manifest(read_manifest(directory), directory / MANIFEST_NAME)


def link_problems(directory: Path, manifest: Manifest) -> list[str]:
    """Listed files reached through a symbolic link (the manifest's paths are already relative and inside)."""
    problems = []
    inside = directory.resolve()
    for name in manifest.files:
        parts = PurePosixPath(name).parts
        steps = [directory.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)]
        if any(step.is_symlink() for step in steps) or not (directory / name).resolve().is_relative_to(inside):
            problems.append(f"{directory / name}: a symbolic link; an artifact holds only regular files")
    return problems


def checksum_problems(directory: Path, manifest: Manifest | Mapping[str, Any]) -> list[str]:
    """One message per file that is missing, altered, or not listed in the manifest. `manifest` may also be
    a JSON object `read_manifest` returned: only its `files` is read."""
    listed: Mapping[str, str] = manifest.files if isinstance(manifest, Manifest) else manifest.get("files", {})
    problems = []
    for name, expected in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing (listed in {MANIFEST_NAME})")
        elif sha256_file(path) != expected:
            problems.append(f"{path}: sha256 differs from {MANIFEST_NAME}: the file was altered")
    for relative in artifact_files(directory):
        if str(relative) not in listed:
            problems.append(f"{directory / relative}: not listed in {MANIFEST_NAME}")
    return problems


def compare_outputs(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray], rtol: float,
                    atol: float) -> OutputCheck:
    worst = 0.0
    matches = True
    for name, expected in reference.items():
        actual = outputs.get(name)
        if actual is None or actual.shape != expected.shape:
            return OutputCheck(False, float("inf"))
        worst = max(worst, float(np.max(np.abs(actual.astype(np.float64) - expected))))
        matches = matches and bool(np.allclose(actual, expected, rtol=rtol, atol=atol))
    return OutputCheck(matches, worst)


def _sample(directory: Path, manifest: Manifest) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    try:
        with np.load(directory / SAMPLE_INPUT_NAME, allow_pickle=False) as data:
            inputs = [data[i.name] for i in manifest.model.inputs]
        with np.load(directory / REFERENCE_OUTPUT_NAME, allow_pickle=False) as data:
            reference = {name: data[name] for name in manifest.model.outputs}
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{directory}: the sample input or reference output does not match {MANIFEST_NAME}'s "
                         f"model inputs and outputs ({exc})") from exc
    return inputs, reference


def check_remote_outputs(directory: Path, manifest: Manifest, remote: RemoteDevice) -> OutputCheck:
    """Run the artifact's library on the device, over RPC, on its sample input; compare with the reference."""
    from edgetune.fleet.session import remote_outputs

    inputs, reference = _sample(directory, manifest)
    outputs = dict(zip(manifest.model.outputs, remote_outputs(remote, directory / LIBRARY_NAME, inputs)))
    tolerance = manifest.verification
    return compare_outputs(outputs, reference, tolerance.rtol, tolerance.atol)


def _native_outputs(directory: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    from edgetune.isolated import in_own_process, processes_with
    from edgetune.runtime import SPIN_COUNT_ENV

    inputs, _ = _sample(directory, manifest)
    library = directory / LIBRARY_NAME
    if manifest.thread_wait is not None and manifest.thread_wait.policy == "pool":  # run as shipped, in its pool:
        # always in a process of its own, as the pool stays in the process that starts it
        with processes_with([{SPIN_COUNT_ENV: "0"}]) as (process,):
            outputs = process.submit(library_outputs, library, manifest.target.device, inputs,
                                     directory / POOL_LIBRARY_NAME).result()
    else:
        outputs = in_own_process(library, library_outputs, library, manifest.target.device, inputs)
    return dict(zip(manifest.model.outputs, outputs))


def library_outputs(library: Path, device_type: str, inputs: list[np.ndarray],
                    pool: Path | None = None) -> list[np.ndarray]:
    """The library's outputs on `inputs`, run on this machine's `device_type` device (its parallel loops in
    edgetune's thread pool `pool` where given, on as many threads as TVM's would use)."""
    import tvm

    from edgetune.runtime import load_library, run

    device = tvm.device(device_type, 0)
    return run(load_library(library, device, pool), inputs, device)


def check_native_outputs(directory: Path, manifest: Manifest) -> OutputCheck:
    """Load the artifact's library in this process with TVM's runtime and compare on the sample input:
    for an artifact this process just built; `verify` runs one from elsewhere in a child process."""
    _, reference = _sample(directory, manifest)
    tolerance = manifest.verification
    return compare_outputs(_native_outputs(directory, manifest), reference, tolerance.rtol, tolerance.atol)


def check_native_outputs_isolated(directory: Path, manifest: Manifest) -> OutputCheck:
    """Run the library in a child Python process that hands back only an .npz of plain arrays."""
    _, reference = _sample(directory, manifest)
    with tempfile.TemporaryDirectory(prefix="edgetune-verify-") as scratch:
        outputs_path = Path(scratch) / "outputs.npz"
        child_code = ("import sys; from edgetune.isolated import keep_torch_out; keep_torch_out(); "
                      "from edgetune.package.verify import run_child; run_child(sys.argv[1], sys.argv[2])")
        command = [sys.executable, "-c", child_code, str(directory), str(outputs_path)]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise _child_failed(directory, f"still running after {CHILD_TIMEOUT_S:.0f} s; stopped")
        if child.returncode != 0 or not outputs_path.is_file():
            tail = (child.stderr or child.stdout).strip().splitlines()[-3:]
            raise _child_failed(directory, f"exit status {child.returncode}: {' '.join(tail)}")
        try:
            with np.load(outputs_path, allow_pickle=False) as data:
                outputs = {name: data[name] for name in data.files}
        except (OSError, ValueError) as exc:
            raise _child_failed(directory, f"its outputs cannot be read ({exc})")
    tolerance = manifest.verification
    return compare_outputs(outputs, reference, tolerance.rtol, tolerance.atol)


def _child_failed(directory: Path, why: str) -> BuildError:
    return BuildError(f"{directory / LIBRARY_NAME}: running the model failed: {why}")


def run_child(directory: str, outputs_path: str) -> None:
    """The child's side: load and run the (already checksummed) artifact, save its outputs."""
    artifact = Path(directory)
    save_arrays(Path(outputs_path), _native_outputs(artifact, load_manifest(artifact)))


def check_program_outputs(directory: Path, manifest: Manifest, program: Path, lib_dir: Path) -> OutputCheck:
    """Run the C++ deploy program on the sample input (under qemu-user for another architecture)."""
    from edgetune.package.deploy import run_program

    inputs, reference = _sample(directory, manifest)
    shapes = {name: (value.shape, str(value.dtype)) for name, value in reference.items()}
    outputs = run_program(program, directory / LIBRARY_NAME, inputs, shapes, manifest.target.arch, lib_dir)
    tolerance = manifest.verification
    return compare_outputs(outputs, reference, tolerance.rtol, tolerance.atol)


@dataclass
class VerifyReport:
    problems: list[str]
    output: OutputCheck | None

    @property
    def ok(self) -> bool:
        return not self.problems and self.output is not None and self.output.matches


def verify_artifact(path: Path, remote: RemoteDevice | None = None,
                    trusted_key: Ed25519PublicKey | None = None) -> VerifyReport:
    """Manifest, checksums and (with `trusted_key`) signature first, a tampered file named; then the
    output: on `remote` (a device behind an RPC tracker) when given, else here in a child process."""
    if path.is_file() and path.name.endswith(".tar.gz"):
        return _verify_archive(path, remote, trusted_key)
    if not path.is_dir():
        raise InputError(f"{path}: no such artifact directory or .tar.gz")
    manifest = load_manifest(path)
    linked = link_problems(path, manifest)
    if linked:
        raise InputError(linked)
    if trusted_key is not None:
        from edgetune.package.signing import signature_problem

        unsigned = signature_problem(path, trusted_key)
        if unsigned is not None:
            return VerifyReport([unsigned], None)
    problems = checksum_problems(path, manifest)
    if problems:
        return VerifyReport(problems, None)
    return _run_checked(path, manifest, remote)


def _verify_archive(path: Path, remote: RemoteDevice | None, trusted_key: Ed25519PublicKey | None) -> VerifyReport:
    """Unpack with every member checked (no links, no `..`, bounded size) into a scratch directory."""
    from edgetune.archive import safe_extract

    with tempfile.TemporaryDirectory(prefix="edgetune-verify-") as scratch:
        safe_extract(path, Path(scratch))
        entries = list(Path(scratch).iterdir())
        if len(entries) != 1 or not entries[0].is_dir():
            raise InputError(f"{path}: expected one artifact directory inside, found {len(entries)} entries")
        root = entries[0]

        def rename(message: str) -> str:  # the archive's members, not the scratch directory they are in
            return message.replace(str(root), f"{path}:{root.name}")

        try:
            report = verify_artifact(root, remote, trusted_key)
        except InputError as exc:
            raise InputError([rename(p) for p in exc.problems]) from exc
        except BuildError as exc:
            raise BuildError(rename(str(exc))) from exc
        report.problems = [rename(p) for p in report.problems]
        return report


def _run_checked(path: Path, manifest: Manifest, remote: RemoteDevice | None) -> VerifyReport:
    """The output check of an artifact whose files all match its manifest."""
    if remote is not None:
        on_device = dataclasses.replace(remote, device=manifest.target.device)
        return VerifyReport([], check_remote_outputs(path, manifest, on_device))
    from edgetune.package.deploy import missing_runner_hint, runner_for
    from edgetune.profiles import machine_isa

    arch, device = manifest.target.arch, manifest.target.device
    if device == "cpu" and arch == machine_isa():
        return VerifyReport([], check_native_outputs_isolated(path, manifest))
    program = path / "bin" / "deploy"
    if device != "cpu" or not program.is_file():
        return VerifyReport([f"{path}: checksums are fine, but this {machine_isa()} machine cannot run a "
                             f"{arch}/{device} artifact" + ("" if device != "cpu" else " without its bundled runtime "
                                                            "(package: {bundle_runtime: true})")], None)
    if runner_for(arch) is None:
        return VerifyReport([f"{path}: checksums are fine; to run it: {missing_runner_hint(arch)}"], None)
    return VerifyReport([], check_program_outputs(path, manifest, program, path / "runtime" / "lib"))
