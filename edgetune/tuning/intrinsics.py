"""Tensorization intrinsics: register those a target's schedule rules can use, not every backend's.

MetaSchedule's TuneContext imports `tvm.s_tir.tensor_intrin`, whose package import registers the
intrinsics of every backend: 33 s here, 24 of them CUDA's tensor-core intrinsics parsed from
TVMScript, once per process, so once per `edgetune build`. A CPU target's rules can only use the
CPU intrinsics (x86 VNNI/AVX-512, Arm dot product and i8mm, RISC-V vector: ~3 s), so for LLVM
targets the package is marked imported and only those are loaded. MetaSchedule gives OpenCL,
Vulkan, Metal and ROCm targets its generic GPU rules, which tensorize nothing: they load none.
CUDA targets (tensor-core rules from sm_75) and any other kind load what the package itself would.
The builder's workers skip the import altogether (tuning/builder.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import tvm

_PACKAGE = "tvm.s_tir.tensor_intrin"
_CPU_MODULES = ("x86", "arm_cpu", "riscv_cpu")
_PACKAGE_MODULES = ("cuda", "arm_cpu", "x86", "rocm", "hexagon", "riscv_cpu")  # what its __init__ imports
_GENERIC_GPU_KINDS = ("opencl", "vulkan", "metal", "rocm")  # MetaSchedule's "cuda" rule kind, no tensor cores


def intrinsic_modules(target: tvm.target.Target) -> tuple[str, ...]:
    """The modules of TVM's intrinsics package whose intrinsics `target`'s schedule rules may use."""
    if target.kind.name == "llvm":
        return _CPU_MODULES
    if target.kind.name in _GENERIC_GPU_KINDS:
        return ()
    return _PACKAGE_MODULES


def register_tensor_intrinsics(target: tvm.target.Target) -> None:
    """Make the intrinsics `target`'s schedule rules may look up available, before any TuneContext."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(_PACKAGE)
        package = importlib.util.module_from_spec(spec)  # not executed: its submodules load on demand
        sys.modules[_PACKAGE] = package
        importlib.import_module("tvm.s_tir").tensor_intrin = package
    for name in intrinsic_modules(target):
        importlib.import_module(f"{_PACKAGE}.{name}")
