"""Check an artifact before it ships: every checksum, then its output against ONNX Runtime's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgetune.errors import InputError
from edgetune.fleet.endpoints import RemoteDevice
from edgetune.package.artifact import (
    LIBRARY_NAME,
    MANIFEST_NAME,
    REFERENCE_OUTPUT_NAME,
    SAMPLE_INPUT_NAME,
    artifact_files,
    sha256_file,
)


@dataclass(frozen=True)
class OutputCheck:
    matches: bool
    max_abs_error: float


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InputError(f"{directory}: no {MANIFEST_NAME}; not an edgetune artifact") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc


def checksum_problems(directory: Path, manifest: dict) -> list[str]:
    """One message per file that is missing, altered, or not listed in the manifest."""
    listed: dict[str, str] = manifest.get("files", {})
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


def compare_outputs(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray], rtol: float, atol: float) -> OutputCheck:
    worst = 0.0
    matches = True
    for name, expected in reference.items():
        actual = outputs[name]
        if actual.shape != expected.shape:
            return OutputCheck(False, float("inf"))
        worst = max(worst, float(np.max(np.abs(actual.astype(np.float64) - expected))))
        matches = matches and bool(np.allclose(actual, expected, rtol=rtol, atol=atol))
    return OutputCheck(matches, worst)


def _sample(directory: Path, manifest: dict) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    with np.load(directory / SAMPLE_INPUT_NAME) as data:
        inputs = [data[i["name"]] for i in manifest["model"]["inputs"]]
    with np.load(directory / REFERENCE_OUTPUT_NAME) as data:
        reference = {name: data[name] for name in manifest["model"]["outputs"]}
    return inputs, reference


def check_native_outputs(directory: Path, manifest: dict) -> OutputCheck:
    """Load the artifact's library in this process with TVM's runtime and compare on the sample input."""
    import tvm

    from edgetune.compile import load_library, run

    device = tvm.device(manifest["target"]["device"], 0)
    inputs, reference = _sample(directory, manifest)
    outputs = dict(zip(manifest["model"]["outputs"], run(load_library(directory / LIBRARY_NAME, device), inputs, device)))
    tolerance = manifest["verification"]
    return compare_outputs(outputs, reference, tolerance["rtol"], tolerance["atol"])


def check_program_outputs(directory: Path, manifest: dict, program: Path, lib_dir: Path) -> OutputCheck:
    """Run the C++ deploy program on the sample input (under qemu-user for another architecture)."""
    from edgetune.package.deploy import run_program

    inputs, reference = _sample(directory, manifest)
    shapes = {name: (value.shape, str(value.dtype)) for name, value in reference.items()}
    outputs = run_program(program, directory / LIBRARY_NAME, inputs, shapes, manifest["target"]["arch"], lib_dir)
    tolerance = manifest["verification"]
    return compare_outputs(outputs, reference, tolerance["rtol"], tolerance["atol"])


@dataclass
class VerifyReport:
    problems: list[str]
    output: OutputCheck | None

    @property
    def ok(self) -> bool:
        return not self.problems and self.output is not None and self.output.matches


def verify_artifact(path: Path, remote: RemoteDevice | None = None) -> VerifyReport:
    """Checksums first (a tampered file is named), then the output: on `remote` (a device behind an
    RPC tracker) when given, else here if this machine can run it."""
    if path.is_file() and path.name.endswith(".tar.gz"):
        import tarfile
        import tempfile

        with tempfile.TemporaryDirectory() as scratch, tarfile.open(path) as archive:
            archive.extractall(scratch, filter="data")
            roots = [p for p in Path(scratch).iterdir() if p.is_dir()]
            if len(roots) != 1:
                raise InputError(f"{path}: expected one artifact directory inside, found {len(roots)}")
            report = verify_artifact(roots[0], remote)
            # Name the archive's members, not the scratch directory they were unpacked into.
            report.problems = [p.replace(str(roots[0]), f"{path}:{roots[0].name}") for p in report.problems]
            return report
    if not path.is_dir():
        raise InputError(f"{path}: no such artifact directory or .tar.gz")
    manifest = read_manifest(path)
    problems = checksum_problems(path, manifest)
    if problems:
        return VerifyReport(problems, None)
    if remote is not None:
        from edgetune.fleet.session import check_remote_outputs

        on_device = dataclasses.replace(remote, device=manifest["target"]["device"])
        return VerifyReport([], check_remote_outputs(path, manifest, on_device))
    from edgetune.package.deploy import missing_runner_hint, runner_for
    from edgetune.profiles import machine_isa

    target = manifest["target"]
    arch, device = target["arch"], target["device"]
    if device == "cpu" and arch == machine_isa():
        return VerifyReport([], check_native_outputs(path, manifest))
    program = path / "bin" / "deploy"
    if device != "cpu" or not program.is_file():
        return VerifyReport([f"{path}: checksums are fine, but this {machine_isa()} machine cannot run a {arch}/{device} "
                             "artifact" + ("" if device != "cpu" else " without its bundled runtime (package: "
                                           "{bundle_runtime: true})")], None)
    if runner_for(arch) is None:
        return VerifyReport([f"{path}: checksums are fine; to run it: {missing_runner_hint(arch)}"], None)
    return VerifyReport([], check_program_outputs(path, manifest, program, path / "runtime" / "lib"))
