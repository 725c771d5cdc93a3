"""Compilers that turn a target's code into a library its device can load, found before any tuning.

A profile names its C compiler (`cross_compiler`, or null for this machine's own); GPU profiles
also need CUDA's nvcc to precompile kernels (without it, the CUDA source is compiled by NVRTC when
the library loads on the device, and the manifest says so). A missing compiler is reported with
what to install, before a single candidate is measured.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgetune.errors import BuildError
from edgetune.profiles import DeviceProfile, machine_isa

_INSTALL_HINTS = {
    "aarch64-linux-gnu-gcc": "apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu",
    "arm-linux-gnueabihf-gcc": "apt-get install gcc-arm-linux-gnueabihf g++-arm-linux-gnueabihf",
}


@dataclass(frozen=True)
class CudaToolkit:
    nvcc: Path
    version: str

    @property
    def root(self) -> Path:
        return self.nvcc.parent.parent


@dataclass(frozen=True)
class Toolchain:
    """How one target's library is linked, and the C++ compiler for its deploy program."""

    arch: str  # the ISA of the device's CPU: x86_64 | aarch64 | armv7
    cc: Path
    cxx: Path | None
    version: str  # first line of `cc --version`
    cuda: CudaToolkit | None = None  # set for CUDA targets when nvcc was found

    @property
    def native(self) -> bool:
        return self.arch == machine_isa()

    def fcompile(self) -> Callable:
        """The export function for `export_library`: a linked shared object the device can dlopen."""
        from tvm.support import cc

        return cc.cross_compiler(str(self.cc))

    def describe(self) -> dict[str, str | None]:
        return {
            "cc": self.cc.name,
            "cc_version": self.version,
            "cxx": self.cxx.name if self.cxx else None,
            "nvcc": self.cuda.version if self.cuda else None,
        }


def device_arch(profile: DeviceProfile) -> str:
    """The CPU architecture the library runs on: the profile's ISA, or its GPU host's."""
    if profile.device == "cpu":
        return profile.isa
    triple = (profile.host or {}).get("mtriple")
    if triple is None:
        return machine_isa()
    return "aarch64" if triple.startswith("aarch64") else "armv7" if triple.startswith("arm") else "x86_64"


def resolve_toolchain(profile: DeviceProfile) -> Toolchain:
    """Find the compilers for `profile`, or raise a BuildError that says what to install."""
    arch = device_arch(profile)
    if profile.cross_compiler is None:
        if arch != machine_isa():
            raise BuildError(
                f"profile '{profile.name}' builds for {arch} but names no cross_compiler, "
                f"and this machine is {machine_isa()}"
            )
        cc = _which(os.environ.get("CC", "gcc")) or _which("cc")
        if cc is None:
            raise BuildError(f"profile '{profile.name}': no C compiler found; install gcc (apt-get install gcc g++)")
        cxx = _which(os.environ.get("CXX", "g++")) or _which("c++")
    elif "android" in profile.cross_compiler:
        cc, cxx = _android_compilers(profile)
    else:
        cc = _which(profile.cross_compiler)
        if cc is None:
            hint = _INSTALL_HINTS.get(profile.cross_compiler, f"a cross compiler named {profile.cross_compiler}")
            raise BuildError(
                f"profile '{profile.name}': cross compiler '{profile.cross_compiler}' not found on PATH; "
                f"install it ({hint})"
            )
        cxx = _which(_cxx_name(profile.cross_compiler))
    cuda = find_cuda() if profile.device == "cuda" else None
    return Toolchain(arch, cc, cxx, _version(cc), cuda)


def check_toolchains(profiles: list[DeviceProfile]) -> dict[str, Toolchain]:
    """Every profile's toolchain, or one BuildError naming every one that is missing."""
    found: dict[str, Toolchain] = {}
    problems = []
    for profile in profiles:
        try:
            found[profile.name] = resolve_toolchain(profile)
        except BuildError as exc:
            problems.append(str(exc))
    if problems:
        raise BuildError("missing toolchains (nothing was tuned):\n" + "\n".join(problems))
    return found


def find_cuda() -> CudaToolkit | None:
    """nvcc from CUDA_PATH, PATH or /usr/local/cuda*; None when there is no toolkit."""
    candidates = []
    if "CUDA_PATH" in os.environ:
        candidates.append(Path(os.environ["CUDA_PATH"]) / "bin" / "nvcc")
    candidates += sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    for nvcc in candidates:
        if nvcc.is_file() and os.access(nvcc, os.X_OK):
            release = next((line for line in _run([str(nvcc), "--version"]).splitlines() if "release" in line), "")
            return CudaToolkit(nvcc.resolve(), release.split("release")[-1].split(",")[0].strip() or "unknown")
    return None


def _android_compilers(profile: DeviceProfile) -> tuple[Path, Path | None]:
    ndk = os.environ.get("ANDROID_NDK_HOME") or os.environ.get("ANDROID_NDK_ROOT")
    if not ndk:
        raise BuildError(
            f"profile '{profile.name}' needs the Android NDK: download it and set ANDROID_NDK_HOME to its directory"
        )
    bins = sorted(Path(ndk).glob("toolchains/llvm/prebuilt/*/bin"))
    for directory in bins:
        cc = directory / profile.cross_compiler
        if cc.is_file():
            cxx = directory / f"{profile.cross_compiler}++"
            return cc, cxx if cxx.is_file() else None
    raise BuildError(
        f"profile '{profile.name}': {profile.cross_compiler} not found under ANDROID_NDK_HOME={ndk} "
        "(expected toolchains/llvm/prebuilt/<host>/bin/); is it an Android NDK r19 or newer?"
    )


def _cxx_name(cc: str) -> str:
    for c, cxx in (("gcc", "g++"), ("clang", "clang++")):
        if cc.endswith(c):
            return cc[: -len(c)] + cxx
    return cc


def _which(name: str) -> Path | None:
    found = shutil.which(name)
    return Path(found) if found else None


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _version(cc: Path) -> str:
    return (_run([str(cc), "--version"]).splitlines() or ["unknown"])[0].strip()
