"""TVM's C++ runtime for a device's architecture: the libraries a deploy program links and loads.

This machine's own come from the installed wheels. Another architecture's come from the same
versions of the apache-tvm and apache-tvm-ffi wheels built for it, fetched once with pip into a
cache (`$EDGETUNE_CACHE`, default `~/.cache/edgetune`), since PyPI carries them for aarch64.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from edgetune.errors import BuildError
from edgetune.ownership import cache_dir
from edgetune.package.artifact import owned_staging_beside, replace_owned_directory
from edgetune.profiles import machine_isa

LIBRARIES = ("libtvm_runtime.so", "libtvm_ffi.so")
_WHEEL_LIBRARY_PATHS = {"apache-tvm": "tvm/lib/libtvm_runtime.so", "apache-tvm-ffi": "tvm_ffi/lib/libtvm_ffi.so"}
_PLATFORMS = {
    "aarch64": ["manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_24_aarch64", "manylinux_2_17_aarch64",
                "manylinux2014_aarch64"],
}


@dataclass(frozen=True)
class RuntimeFiles:
    arch: str
    lib_dir: Path  # holds LIBRARIES
    include_dir: Path  # tvm/ffi/*.h and dlpack/, the headers a deploy program compiles against
    versions: dict[str, str]


def runtime_files(arch: str) -> RuntimeFiles:
    """TVM's runtime libraries for `arch` and the headers to build against them."""
    import tvm_ffi

    versions = {name: metadata.version(name) for name in _WHEEL_LIBRARY_PATHS}
    directory = cache_dir() / "runtime" / f"{versions['apache-tvm']}-{versions['apache-tvm-ffi']}-{arch}"
    if not _complete(directory):
        if arch == machine_isa():
            _copy_installed(directory)
        elif arch in _PLATFORMS:
            _fetch(arch, versions, directory)
        else:
            raise BuildError(f"no TVM runtime wheels are published for {arch}; build TVM's runtime for it yourself")
    return RuntimeFiles(arch, directory, Path(tvm_ffi.__file__).parent / "include", versions)


def _complete(directory: Path) -> bool:
    return all((directory / lib).is_file() for lib in LIBRARIES)


def _copy_installed(directory: Path) -> None:
    """This machine's libraries from the installed wheels, copied beside the cache entry and renamed into place:
    builds running at once (a release's workers, the tests' two) never read a half-copied library."""
    with owned_staging_beside(directory) as staging:
        for name, member in _WHEEL_LIBRARY_PATHS.items():
            shutil.copyfile(_installed_file(name, member), staging / Path(member).name)
        _put_in_place(staging, directory)


def _put_in_place(staging: Path, directory: Path) -> None:
    """`staging` in place of `directory`, unless another build filled the entry meanwhile: the same versions' same
    files, so its copy stands (replacing it would take it away for an instant from a build reading it)."""
    if not _complete(directory):
        try:
            replace_owned_directory(staging, directory)
            return
        except OSError:  # another build renamed its copy into place between the check and the rename
            if not _complete(directory):
                raise
    shutil.rmtree(staging, ignore_errors=True)


def _installed_file(distribution: str, member: str) -> Path:
    for file in metadata.files(distribution) or []:
        if str(file) == member:
            return Path(file.locate())
    raise BuildError(f"the installed {distribution} has no {member}; reinstall it")


def _fetch(arch: str, versions: dict[str, str], directory: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   "--python-version", f"{sys.version_info.major}{sys.version_info.minor}", "--dest", scratch]
        for platform in _PLATFORMS[arch]:
            command += ["--platform", platform]
        command += [f"{name}=={version}" for name, version in versions.items()]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(
                f"could not download TVM's {arch} runtime wheels ({', '.join(f'{n}=={v}' for n, v in versions.items())}) "
                f"with pip: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no output'}"
            )
        # a cache directory someone else made is left alone
        with owned_staging_beside(directory) as staging:
            for wheel in Path(scratch).glob("*.whl"):
                with zipfile.ZipFile(wheel) as archive:
                    for member in _WHEEL_LIBRARY_PATHS.values():
                        if member in archive.namelist():
                            (staging / Path(member).name).write_bytes(archive.read(member))
            missing = [lib for lib in LIBRARIES if not (staging / lib).is_file()]
            if missing:
                raise BuildError(f"TVM's {arch} wheels lack {', '.join(missing)}")
            _put_in_place(staging, directory)
