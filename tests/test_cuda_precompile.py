"""CUDA kernels ship precompiled by nvcc (a fatbin for the profile's arch), not as CUDA source."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from edgetune.compile import compile_model, export_library
from edgetune.cuda_precompile import fatbin_images, precompile_cuda
from edgetune.errors import BuildError
from edgetune.frontend.onnx import load_model, to_relax
from edgetune.profiles import load_profile
from edgetune.toolchains import find_cuda

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def nvcc() -> Path:
    toolkit = find_cuda()
    if toolkit is None:
        pytest.fail("nvcc not found: install the CUDA toolkit at /usr/local/cuda-13.0 (or set CUDA_PATH)")
    return toolkit.nvcc


def tiny_cnn_for_a100():
    target = load_profile("a100").tvm_target()
    mod = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    with target:
        return compile_model(mod, target, None), target


def cuda_formats(library: bytes) -> list[bytes]:
    """The format field of every CUDA module record in the library's embedded module blob."""
    formats, start = [], 0
    kind = struct.pack("<Q", 4) + b"cuda"
    while (start := library.find(kind, start)) != -1:
        pos = start + len(kind) + 8  # skip the record's payload size
        (size,) = struct.unpack_from("<Q", library, pos)
        if size < 16:
            formats.append(library[pos + 8 : pos + 8 + size])
        start += len(kind)
    return formats


def test_exported_library_carries_sm80_kernels_compiled_by_nvcc(nvcc, tmp_path) -> None:
    executable, target = tiny_cnn_for_a100()
    assert target.arch == "sm_80"
    source = export_library(executable, tmp_path / "source.so").read_bytes()
    assert b"__global__" in source and cuda_formats(source) == [b"cuda"]  # what TVM ships by itself

    assert precompile_cuda(executable, target.arch, nvcc) == "fatbin"
    library = export_library(executable, tmp_path / "model.so").read_bytes()

    assert cuda_formats(library) == [b"fatbin"]
    assert ("elf", 80) in fatbin_images(library)  # SASS for sm_80
    assert ("ptx", 80) in fatbin_images(library)  # and its PTX, for newer GPUs
    assert b"__global__" not in library  # no CUDA source left to compile on the device
    assert library[:4] == b"\x7fELF"


def test_nvcc_failure_is_a_build_error(nvcc, tmp_path) -> None:
    executable, _ = tiny_cnn_for_a100()
    broken = tmp_path / "nvcc"
    broken.write_text("#!/bin/sh\necho 'fatal: simulated nvcc failure' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(BuildError, match="nvcc failed .*sm_80(.|\n)*simulated nvcc failure"):
        precompile_cuda(executable, "sm_80", broken)
    with pytest.raises(BuildError, match="sm_80"):
        precompile_cuda(executable, "compute80", nvcc)
