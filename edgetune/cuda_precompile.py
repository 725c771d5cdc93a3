"""Ship CUDA kernels precompiled by nvcc instead of CUDA C source compiled on the device at load time.

Why this is needed (TVM 0.27): `target.build.cuda` hands the generated CUDA C source to
`CUDAModuleCreateWithFallback(code, "cuda", ...)`. When the CUDA runtime plugin
(`libtvm_runtime_cuda.so`, which needs the driver's `libcuda.so.1`) is loaded, that factory is
`ffi.Module.create.cuda` and compiles the source at once through `tvm_callback_cuda_compile`. On a
machine without a driver the plugin cannot load, so codegen falls back to a module that only keeps
the source (format "cuda"); the exported library then carries that source, and the device's TVM
runtime compiles it (NVRTC by default) every time the library is loaded.

`precompile_cuda` compiles that source with nvcc now, for the given arch, and makes the
executable's `export_library` embed the result (format "fatbin": SASS for the arch plus its PTX) in
place of the source. It does so through `export_library`'s `fpack_imports` hook: the imports are
serialized as TVM always does (`runtime.ModulePackImportsToTensor`), each CUDA module's record
`<fmt><function table><code>` gets the new format and code, and the blob becomes the same
`__tvm_ffi__library_bin` object TVM's own packer writes (`codegen.codegen_blob`). The device's
runtime (`ffi.Module.load_from_bytes.cuda`) then hands the fatbin to `cuModuleLoadData` as is.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from pathlib import Path

import tvm_ffi

from edgetune.errors import BuildError

FORMAT = "fatbin"
_ARCH = re.compile(r"sm_(\d+[a-z]?)")
_U64 = struct.Struct("<Q")

# The flags TVM's own nvcc path uses (tvm/support/nvcc.py, _compile_cuda_nvcc), so the kernels
# are the ones the device would have compiled from the same source.
_NVCC_FLAGS = [
    "-O3",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "--ptxas-options=--register-usage-level=10,--warn-on-local-memory-usage",
]


def precompile_cuda(executable, arch: str, nvcc: Path) -> str:
    """Compile the executable's CUDA kernels with `nvcc` for `arch` ("sm_80"); embed them on export.

    From then on `executable.export_library(...)` (any arguments) writes the nvcc output instead of
    the CUDA source. Returns the embedded format, "fatbin". Raises BuildError when nvcc fails or
    the executable has no CUDA kernels. Kernels TVM already compiled while building (it does when
    the CUDA runtime is loaded, i.e. on a machine with a driver) are left as they are.
    """
    match = _ARCH.fullmatch(arch)
    if match is None:
        raise BuildError(f"CUDA arch must look like 'sm_80', got {arch!r}")
    cuda_modules = [m for m in _import_tree(executable.mod) if m.kind == "cuda"]
    if not cuda_modules:
        raise BuildError("the executable has no CUDA kernels to precompile (was it built for a CUDA target?)")
    binaries = {}
    for module in cuda_modules:
        if module.is_runnable():  # a real CUDA module: TVM compiled its kernels when it was built
            continue
        source = module.inspect_source("cuda")
        if not source:
            raise BuildError("a CUDA module of the executable holds neither CUDA source nor compiled kernels")
        binaries[source.encode()] = _nvcc_fatbin(source, match.group(1), Path(nvcc))

    original = type(executable).export_library

    def export_library(file_name, **kwargs):
        kwargs.setdefault("fpack_imports", lambda *args: _pack_imports(binaries, *args))
        return original(executable, file_name, **kwargs)

    executable.export_library = export_library
    return FORMAT


def _nvcc_fatbin(source: str, version: str, nvcc: Path) -> bytes:
    with tempfile.TemporaryDirectory(prefix="edgetune-nvcc-") as tmp:
        cu, out = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.fatbin"
        cu.write_text(source)
        gencode = f"arch=compute_{version},code=[sm_{version},compute_{version}]"
        cmd = [str(nvcc), "--fatbin", "-gencode", gencode, *_NVCC_FLAGS, "-o", str(out), str(cu)]
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        except OSError as exc:
            raise BuildError(f"could not run nvcc ({nvcc}): {exc}; install the CUDA toolkit") from exc
        if proc.returncode != 0 or not out.is_file() or out.stat().st_size == 0:
            log = (proc.stdout + proc.stderr).strip()
            raise BuildError(
                f"nvcc failed (exit {proc.returncode}) compiling the CUDA kernels for sm_{version}:\n"
                f"  {' '.join(cmd)}\n{log[-4000:]}"
            )
        return out.read_bytes()


def _import_tree(root) -> list:
    seen, stack, found = {id(root)}, [root], []
    while stack:
        module = stack.pop()
        found.append(module)
        for child in module.imports:
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return found


def _pack_imports(binaries: dict[bytes, bytes], mod, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
    """`fpack_imports` for Module.export_library: TVM's packing, with CUDA source swapped for fatbins."""
    blob = _ffi("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes()
    blob = replace_cuda_code(blob, binaries)
    hosts = [m for m in _import_tree(mod) if m.kind == "llvm"]
    codegen_blob = tvm_ffi.get_global_func("codegen.codegen_blob", allow_missing=True)
    if codegen_blob is not None and hosts:
        path = os.path.join(workspace_dir, f"{prefix}devc.o")
        target = hosts[0].get_function("_get_target_string")()
        codegen_blob(blob, is_system_lib, target, prefix).write_to_file(path)
        return path
    # No LLVM: the C file TVM would write, with this blob as its array.
    c_text = _ffi("runtime.ModulePackImportsToC")(mod, is_system_lib, prefix)
    array = re.compile(r"(__tvm_ffi__library_bin\[)\d+(\] = \{).*?(\n\};)", re.DOTALL)
    body = "".join(("\n  " if i % 20 == 0 else "") + f"0x{byte:02x}," for i, byte in enumerate(blob))
    c_text, count = array.subn(lambda m: f"{m.group(1)}{len(blob)}{m.group(2)}{body}{m.group(3)}", c_text, count=1)
    if count != 1:
        raise BuildError("cannot find the library blob in TVM's packed C source")
    path = os.path.join(workspace_dir, f"{prefix}devc.c")
    Path(path).write_text(c_text)
    return path


def replace_cuda_code(blob: bytes, binaries: dict[bytes, bytes]) -> bytes:
    """Rewrite a `__tvm_ffi__library_bin` blob: every CUDA module holding source gets its fatbin.

    Layout (tvm_ffi src/ffi/extra/library_module.cc, ProcessLibraryBin):
    <nbytes:u64> <indptr:vec<u64>> <children:vec<u64>> then per module <kind:str> [<payload:bytes>]
    ("_lib" has no payload). A "cuda" payload is <fmt:str> <function table> <code:bytes>, the code
    last (CUDAModuleNode::SaveToBytes), so the source is found at its end.
    """
    if _U64.unpack_from(blob, 0)[0] != len(blob) - _U64.size:
        raise BuildError("unexpected layout of TVM's library blob (size header)")
    n_modules = _U64.unpack_from(blob, _U64.size)[0] - 1  # the CSR indptr has one entry per module, plus one
    pos = _U64.size
    for _ in range(2):  # the import tree's two u64 vectors, copied as they are
        pos += _U64.size * (1 + _U64.unpack_from(blob, pos)[0])
    out = [blob[_U64.size : pos]]
    for _ in range(n_modules):
        kind, pos = _read(blob, pos)
        out.append(_str(kind))
        if kind == b"_lib":
            continue
        payload, pos = _read(blob, pos)
        if kind == b"cuda":
            payload = _replace_code(payload, binaries)
        out.append(_str(payload))
    if pos != len(blob):
        raise BuildError("unexpected layout of TVM's library blob (trailing bytes)")
    body = b"".join(out)
    return _U64.pack(len(body)) + body


def _replace_code(payload: bytes, binaries: dict[bytes, bytes]) -> bytes:
    fmt, start = _read(payload, 0)
    if fmt != b"cuda":
        return payload  # already compiled by TVM
    for source, binary in binaries.items():
        tail = _str(source)
        if payload.endswith(tail):
            return _str(FORMAT.encode()) + payload[start : len(payload) - len(tail)] + _str(binary)
    raise BuildError("a CUDA module's source changed after precompile_cuda; call it again")


def _read(data: bytes, pos: int) -> tuple[bytes, int]:
    (size,) = _U64.unpack_from(data, pos)
    pos += _U64.size
    if pos + size > len(data):
        raise BuildError("unexpected layout of TVM's library blob (field past its end)")
    return data[pos : pos + size], pos + size


def _str(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _ffi(name: str):
    return tvm_ffi.get_global_func(name)


def fatbin_images(data: bytes) -> list[tuple[str, int]]:
    """The images in every fatbin inside `data` (a fatbin, or a library embedding some):
    ("elf", 80) is SASS for sm_80, ("ptx", 80) is PTX for compute_80.

    Fatbin layout: header <magic:u32 0xBA55ED50> <version:u16> <header size:u16> <size:u64>, then
    entries <kind:u16 1=PTX 2=ELF> <version:u16> <header size:u32> <payload size:u64> ... with the
    arch as the u32 at offset 28 of the entry header.
    """
    images, start = [], 0
    while (start := data.find(b"\x50\xed\x55\xba", start)) != -1:
        _, header, size = struct.unpack_from("<HHQ", data, start + 4)
        pos, end = start + header, start + header + size
        while pos + 32 <= min(end, len(data)):
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, pos)
            images.append(({1: "ptx", 2: "elf"}.get(kind, str(kind)), struct.unpack_from("<I", data, pos + 28)[0]))
            pos += entry_header + payload
        start = max(end, start + 4)
    return images
