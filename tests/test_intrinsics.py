"""Tuning a CPU or OpenCL target registers the intrinsics its schedule rules can use, not every backend's: a CPU
target its own ISA's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, tvm
from edgetune.tuning.intrinsics import register_tensor_intrinsics
from tvm.s_tir._tensor_intrin import TensorIntrin
register_tensor_intrinsics(tvm.target.Target({KIND}))
from tvm.s_tir import meta_schedule as ms
from tvm import te
for dtype, acc in (("float32", "float32"), ("uint8", "int32"), ("int8", "int32")):  # int8: the dot-product rules
    a = te.placeholder((64, 64), name="A", dtype=dtype)
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k].astype(acc) * a[k, j].astype(acc), axis=k), name="C")
    context = ms.TuneContext(mod=tvm.IRModule({{"main": te.create_prim_func([a, c])}}),
                             target=tvm.target.Target({KIND}), space_generator="post-order-apply",
                             search_strategy="evolutionary", num_threads=1)
    assert context.generate_design_space()
for name in ("dot_16x4_vnni", "dot_4x4_i8i8s32_sdot", "wmma_sync_16x16x16_f16f16f32"):
    print(name, TensorIntrin.get(name, allow_missing=True) is not None)
print("cuda module", "tvm.s_tir.tensor_intrin.cuda" in sys.modules)
"""


def _registered(kind: dict) -> str:
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(KIND=repr(kind))], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_an_x86_target_gets_the_x86_intrinsics_only() -> None:
    out = _registered({"kind": "llvm", "mcpu": "cascadelake", "num-cores": 2})
    assert "dot_16x4_vnni True" in out and "dot_4x4_i8i8s32_sdot False" in out
    assert "wmma_sync_16x16x16_f16f16f32 False" in out and "cuda module False" in out


def test_an_arm_target_gets_the_arm_intrinsics_only() -> None:
    """Cross-compiled from this x86 machine: the target's triple decides, not this machine's."""
    from edgetune.profiles import resolve_profile

    for profile in ("cortex-a53", "raspberry-pi-4"):
        out = _registered(dict(resolve_profile(profile, None).target))
        assert "dot_16x4_vnni False" in out and "dot_4x4_i8i8s32_sdot True" in out and "cuda module False" in out


def test_an_opencl_target_generates_its_space_without_any_intrinsics() -> None:
    out = _registered({"kind": "opencl", "device": "mali", "max_threads_per_block": 256,
                       "max_shared_memory_per_block": 16384, "thread_warp_size": 1})
    assert "dot_16x4_vnni False" in out and "wmma_sync_16x16x16_f16f16f32 False" in out and "cuda module False" in out


def test_a_cuda_target_gets_every_module_tvm_registers() -> None:
    """What TVM's package import would load (importing it takes ~100 s here: CUDA's intrinsics are parsed)."""
    import ast
    import importlib.util

    import tvm

    from edgetune.profiles import resolve_profile
    from edgetune.tuning.intrinsics import intrinsic_modules

    package = Path(importlib.util.find_spec("tvm.s_tir.tensor_intrin").origin)
    imported = {alias.name for node in ast.walk(ast.parse(package.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}
    assert "cuda" in imported
    assert set(intrinsic_modules(tvm.target.Target(dict(resolve_profile("a100", None).target)))) == imported


def test_the_stack_tvmscript_sees_while_intrinsics_load_holds_what_its_parser_reads() -> None:
    """The shallow stack has every frame and line number; the source lines of the first three frames (the
    parser reads the third's: a class body?); TVMScript still parses a prim_func alone and in an ir_module."""
    import inspect

    import tvm
    from tvm.script import ir as I
    from tvm.script import tirx as T

    from edgetune.tuning.intrinsics import _shallow_stack, _stack_without_deep_lines

    def both() -> tuple[list, list]:
        return _shallow_stack(), inspect.stack()

    shallow, full = both()
    assert [f.frame for f in shallow] == [f.frame for f in full] and len(full) > 3
    assert [f.lineno for f in shallow] == [f.lineno for f in full]
    assert [f.code_context for f in shallow[:3]] == [f.code_context for f in full[:3]]
    assert all(f.code_context is None for f in shallow[3:])

    with _stack_without_deep_lines():
        @T.prim_func
        def alone(a: T.Buffer((4,), "float32")):
            for i in range(4):
                a[i] = T.float32(1)

        @I.ir_module
        class Module:
            @T.prim_func
            def main(a: T.Buffer((4,), "float32")):
                for i in range(4):
                    a[i] = T.float32(2)

    assert isinstance(alone, tvm.tirx.PrimFunc) and isinstance(Module, tvm.IRModule)
    assert isinstance(Module["main"], tvm.tirx.PrimFunc)
    from tvm.tirx.script.parser import entry

    assert entry.inspect is inspect  # restored
