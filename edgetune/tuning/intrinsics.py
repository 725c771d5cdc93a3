"""Tensorization intrinsics: register those a target's schedule rules can use, not every backend's.

MetaSchedule's TuneContext imports `tvm.s_tir.tensor_intrin`, whose package import registers the
intrinsics of every backend: 33 s here, 24 of them CUDA's tensor-core intrinsics parsed from
TVMScript, once per process, so once per `edgetune build`. A CPU target's rules can only use its own
ISA's intrinsics, which MetaSchedule's rules look up by name when a TuneContext is made (x86 VNNI and
AVX-512: 0.4 s; Arm dot product and i8mm: 1.5-2.5 s, most of a small build's tuning start), so for LLVM
targets the package is marked imported and only the target ISA's module is loaded (all three CPU ones
for an ISA not named here). MetaSchedule gives OpenCL,
Vulkan, Metal and ROCm targets its generic GPU rules, which tensorize nothing: they load none.
CUDA targets (tensor-core rules from sm_75) and any other kind load what the package itself would.
The builder's workers skip the import altogether (tuning/builder.py).

Each intrinsic is TVMScript, and TVMScript's `prim_func` decorator calls `inspect.stack()`, which reads the
source line of every frame on the stack, and for frames of frozen modules (an import's) or of parsed code
searches all of `sys.modules` for their file: 14 of the CUDA intrinsics' 18 s here, more under a deeper
stack (a test runner's). The parser reads the line of one frame (the decorator's caller's caller: is it a
class body?) and the frame objects themselves, so while the intrinsics load, its `inspect.stack()` gives
the first three frames in full and the others without their source line (`_stack_without_deep_lines`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import tvm

_PACKAGE = "tvm.s_tir.tensor_intrin"
_CPU_MODULES = ("x86", "arm_cpu", "riscv_cpu")
_CPU_MODULE_OF_TRIPLE = (("x86_64", "x86"), ("i386", "x86"), ("i686", "x86"), ("aarch64", "arm_cpu"),
                         ("arm", "arm_cpu"), ("thumb", "arm_cpu"), ("riscv", "riscv_cpu"))
_PACKAGE_MODULES = ("cuda", "arm_cpu", "x86", "rocm", "hexagon", "riscv_cpu")  # what its __init__ imports
_GENERIC_GPU_KINDS = ("opencl", "vulkan", "metal", "rocm")  # MetaSchedule's "cuda" rule kind, no tensor cores


def intrinsic_modules(target: tvm.target.Target) -> tuple[str, ...]:
    """The modules of TVM's intrinsics package whose intrinsics `target`'s schedule rules may use."""
    if target.kind.name == "llvm":
        return _cpu_modules(target)
    if target.kind.name in _GENERIC_GPU_KINDS:
        return ()
    return _PACKAGE_MODULES


def _cpu_modules(target: tvm.target.Target) -> tuple[str, ...]:
    """The intrinsics module of the LLVM target's ISA, read from its triple (this machine's when it names
    none); every CPU module for an ISA without one of its own."""
    from tvm.target import codegen

    triple = str(target.attrs.get("mtriple", "") or codegen.llvm_get_system_triple())
    if "arm_cpu" in target.keys:
        return ("arm_cpu",)
    return next(((module,) for prefix, module in _CPU_MODULE_OF_TRIPLE if triple.startswith(prefix)), _CPU_MODULES)


def register_tensor_intrinsics(target: tvm.target.Target) -> None:
    """Make the intrinsics `target`'s schedule rules may look up available, before any TuneContext."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(_PACKAGE)
        package = importlib.util.module_from_spec(spec)  # not executed: its submodules load on demand
        sys.modules[_PACKAGE] = package
        importlib.import_module("tvm.s_tir").tensor_intrin = package
    missing = [name for name in intrinsic_modules(target) if f"{_PACKAGE}.{name}" not in sys.modules]
    if missing:
        with _stack_without_deep_lines():
            for name in missing:
                importlib.import_module(f"{_PACKAGE}.{name}")


_FRAMES_IN_FULL = 3
"""`is_defined_in_class` (tvm.script.parser.core.utils) reads the source line of the stack's third frame."""


def _shallow_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """`inspect.stack(context)`, with the source line and position of the first _FRAMES_IN_FULL frames only."""
    frame = sys._getframe(1)
    frames: list[inspect.FrameInfo] = []
    while frame is not None:
        if len(frames) < _FRAMES_IN_FULL:
            frames.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
        else:
            frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                            None, None))
        frame = frame.f_back
    return frames


@contextmanager
def _stack_without_deep_lines() -> Iterator[None]:
    """TVMScript's `prim_func` sees `_shallow_stack` as `inspect.stack` (see the module doc); restored after."""
    from tvm.tirx.script.parser import entry

    shallow = types.ModuleType("inspect")
    shallow.__dict__.update(inspect.__dict__)
    shallow.stack = _shallow_stack
    saved, entry.inspect = entry.inspect, shallow
    try:
        yield
    finally:
        entry.inspect = saved
