"""The C++ deploy program: built from the artifact's own `deploy/` sources, run natively or under qemu.

Building it with the artifact's CMakeLists.txt and running it on the sample input is how an artifact
for another architecture is verified here: the same program a board without Python would run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from edgetune.errors import BuildError
from edgetune.package.runtime import RuntimeFiles
from edgetune.profiles import machine_isa
from edgetune.toolchains import Toolchain

_QEMU = {"aarch64": ("qemu-aarch64", "/usr/aarch64-linux-gnu"), "armv7": ("qemu-arm", "/usr/arm-linux-gnueabihf")}
HEADER_DIRS = ("tvm", "dlpack")


def stage_runtime(runtime: RuntimeFiles, directory: Path) -> Path:
    """Lay out `include/` and `lib/` as the CMakeLists expects them (the artifact's `runtime/`)."""
    for name in HEADER_DIRS:
        shutil.copytree(runtime.include_dir / name, directory / "include" / name, dirs_exist_ok=True)
    (directory / "lib").mkdir(parents=True, exist_ok=True)
    for library in sorted(runtime.lib_dir.iterdir()):
        shutil.copyfile(library, directory / "lib" / library.name)
    return directory


def build_program(sources: Path, toolchain: Toolchain, runtime_dir: Path, output: Path) -> Path:
    """Configure and build `sources/CMakeLists.txt` for the toolchain's architecture; copy the program to `output`."""
    if toolchain.cxx is None:
        raise BuildError(f"no C++ compiler for {toolchain.arch} beside {toolchain.cc}; install its g++")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise BuildError("cmake not found; install it (apt-get install cmake) to build the C++ deploy program")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        # Paths of the sources and headers end up in the binary through __FILE__: map them away.
        flags = f"-ffile-prefix-map={sources}=deploy -ffile-prefix-map={runtime_dir}=runtime -ffile-prefix-map={work}=."
        configure = [
            cmake, "-S", str(sources), "-B", str(work), f"-DTVM_RUNTIME_DIR={runtime_dir}",
            f"-DCMAKE_CXX_COMPILER={toolchain.cxx}", f"-DCMAKE_CXX_FLAGS={flags}",
        ]
        if not toolchain.native:
            configure += ["-DCMAKE_SYSTEM_NAME=Linux", f"-DCMAKE_SYSTEM_PROCESSOR={toolchain.arch}"]
        for command in (configure, [cmake, "--build", str(work)]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise BuildError(f"building the C++ deploy program failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "deploy", output)
    output.chmod(0o755)
    return output


def runner_for(arch: str) -> list[str] | None:
    """How to start a program built for `arch` here: directly, under qemu-user, or None if neither can."""
    if arch == machine_isa():
        return []
    qemu = _QEMU.get(arch)
    if qemu is None or shutil.which(qemu[0]) is None:
        return None
    return [qemu[0]]


def missing_runner_hint(arch: str) -> str:
    return f"{_QEMU[arch][0]} not found (apt-get install qemu-user)" if arch in _QEMU else f"cannot run {arch} here"


def run_program(
    program: Path,
    library: Path,
    inputs: list[np.ndarray],
    outputs: dict[str, tuple[tuple[int, ...], str]],
    arch: str,
    lib_dir: Path,
) -> dict[str, np.ndarray]:
    """Run the deploy program on `inputs`; `outputs` gives each output's name, shape and dtype, in order."""
    runner = runner_for(arch)
    if runner is None:
        raise BuildError(missing_runner_hint(arch))
    environment = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir)}
    if runner:
        environment["QEMU_LD_PREFIX"] = _QEMU[arch][1]
    with tempfile.TemporaryDirectory() as scratch:
        paths = []
        for index, value in enumerate(inputs):
            path = Path(scratch) / f"input{index}.bin"
            np.ascontiguousarray(value).tofile(path)
            paths.append(str(path))
        prefix = str(Path(scratch) / "output")
        done = subprocess.run([*runner, str(program), str(library.resolve()), *paths, prefix],
                              capture_output=True, text=True, env=environment, timeout=600)
        if done.returncode != 0:
            raise BuildError(f"the deploy program failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        return {
            name: np.fromfile(f"{prefix}{index}.bin", dtype=dtype).reshape(shape)
            for index, (name, (shape, dtype)) in enumerate(outputs.items())
        }
