"""Artifacts for devices that are not this machine: cross-compiled, reproducible, verified under qemu."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import run_edgetune as edgetune

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "qemu-aarch64", "cmake")


@pytest.fixture(scope="module", autouse=True)
def cross_tools() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu "
                    "qemu-user cmake (.ci/run installs them)")


def build_ci_recipe(directory: Path) -> Path:
    """recipes/ci-aarch64.yaml, built into `directory`; returns the archive."""
    directory.mkdir(parents=True, exist_ok=True)
    recipe = directory / "ci-aarch64.yaml"
    recipe.write_text((REPO / "recipes" / "ci-aarch64.yaml").read_text().replace("output: ../build", "output: out"))
    run = edgetune("build", recipe.name, "--json", "summary.json", cwd=directory)
    assert run.returncode == 0, run.stdout + run.stderr
    return directory / "out" / "ci-aarch64" / "rpi4.tar.gz"


@pytest.fixture(scope="module")
def aarch64_archive(tmp_path_factory) -> Path:
    return build_ci_recipe(tmp_path_factory.mktemp("first"))


def test_aarch64_artifact_is_verified_under_qemu(aarch64_archive: Path) -> None:
    summary = json.loads((aarch64_archive.parent.parent.parent / "summary.json").read_text())["targets"]["rpi4"]
    assert summary["verified"] is True and summary["verification"] == "matched"
    manifest = json.loads((aarch64_archive.parent / "rpi4" / "manifest.json").read_text())
    assert manifest["verification"]["methods"] == ["C++ deploy program under qemu-aarch64"]
    assert manifest["target"]["arch"] == "aarch64" and manifest["runtime_bundled"] is True
    assert manifest["toolchain"]["cc"] == "aarch64-linux-gnu-gcc"
    assert manifest["latency_ms"]["tuned"] is None  # no board here to time it on
    for name in ("model.so", "bin/deploy", "runtime/lib/libtvm_runtime.so", "runtime/lib/libtvm_ffi.so",
                 "deploy/deploy.cc", "deploy/CMakeLists.txt", "run.py", "sample_input.npz", "reference_output.npz"):
        assert name in manifest["files"], name
    library = (aarch64_archive.parent / "rpi4" / "model.so").read_bytes()
    assert library[:4] == b"\x7fELF" and library[18] == 183  # e_machine EM_AARCH64


def test_verify_runs_the_archive_under_qemu(aarch64_archive: Path) -> None:
    run = edgetune("verify", str(aarch64_archive), cwd=aarch64_archive.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK" in run.stdout


def test_verify_names_a_tampered_library(aarch64_archive: Path, tmp_path: Path) -> None:
    with tarfile.open(aarch64_archive) as archive:
        archive.extractall(tmp_path, filter="data")
    library = tmp_path / "rpi4" / "model.so"
    library.write_bytes(library.read_bytes()[:-16] + b"\0" * 16)
    run = edgetune("verify", str(tmp_path / "rpi4"), cwd=tmp_path)
    assert run.returncode == 1
    assert "model.so: sha256 differs" in run.stderr


def test_same_recipe_and_records_give_byte_identical_archives(aarch64_archive: Path, tmp_path: Path) -> None:
    second = build_ci_recipe(tmp_path / "elsewhere")
    assert second.read_bytes() == aarch64_archive.read_bytes()


def test_missing_toolchain_fails_before_tuning_and_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "name: r\nmodel: {zoo: tiny_cnn}\n"
        "fleet:\n"
        "  - {name: host, profile: host}\n"
        "  - {name: phone, profile: adreno-640}\n"
        "  - {name: board, profile: cortex-a53, overrides: {cross_compiler: armv9-nonexistent-gcc}}\n"
        "tuning: {trials_per_task: 4}\noutput: out\n"
    )
    run = edgetune("build", "r.yaml", cwd=tmp_path, timeout=120)
    assert run.returncode == 1
    assert "ANDROID_NDK_HOME" in run.stderr
    assert "armv9-nonexistent-gcc' not found on PATH" in run.stderr
    assert not (tmp_path / "out").exists()


def test_device_that_cannot_be_measured_here_needs_rpc_or_no_tuning(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "name: r\nmodel: {zoo: tiny_cnn}\nfleet: [{name: rpi4, profile: raspberry-pi-4}]\n"
        "tuning: {trials_per_task: 4}\noutput: out\n"
    )
    run = edgetune("build", "r.yaml", cwd=tmp_path, timeout=300)
    assert run.returncode == 1
    assert "cannot be measured on this machine" in run.stdout + run.stderr


def test_cuda_artifact_ships_nvcc_kernels_and_says_it_was_not_run(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "name: gpu\nmodel: {zoo: tiny_cnn}\nfleet: [{name: a100, profile: a100}]\n"
        "tuning: {trials_per_task: 0}\noutput: out\n"
    )
    run = edgetune("build", "r.yaml", "--json", "summary.json", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())["targets"]["a100"]
    assert summary["verified"] is False
    assert summary["verification"] == "not run: no cuda device on this machine"
    artifact = tmp_path / "out" / "gpu" / "a100"
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["cuda_kernels"].startswith("fatbin for sm_80, precompiled with nvcc")
    assert b"__global__" not in (artifact / "model.so").read_bytes()
    verify = edgetune("verify", str(tmp_path / "out" / "gpu" / "a100.tar.gz"), cwd=tmp_path)
    assert verify.returncode == 1
    assert "a100.tar.gz:a100: checksums are fine" in verify.stderr


def test_host_artifact_with_bundled_runtime_runs_its_cpp_program_natively(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "name: native\nmodel: {zoo: tiny_cnn}\nfleet: [{name: host, profile: host}]\n"
        "tuning: {trials_per_task: 0}\npackage: {bundle_runtime: true}\noutput: out\n"
    )
    run = edgetune("build", "r.yaml", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((tmp_path / "out" / "native" / "host" / "manifest.json").read_text())
    assert manifest["verification"]["methods"] == ["TVM's Python runtime, this machine",
                                                   "C++ deploy program, this machine"]
    assert manifest["verification"]["matches"] is True
    assert manifest["latency_ms"]["tuned"] > 0
