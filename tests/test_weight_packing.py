"""Weights packed into a tuned kernel's layout are computed in numpy at compile time (edgetune/weight_packing.py)
where relax's FoldConstant compiled each packing with LLVM: the same values, the padding zero."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import library_outputs, main_constants, tiny_build_inputs
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from edgetune import weight_packing

BIAS = np.arange(96, dtype="float32") - 40.5
WEIGHT = np.linspace(-3, 3, 384 * 96, dtype="float32").reshape(1, 1, 384, 96)


def _packing_module():
    """A 1x1 convolution's bias and weight packed as a tuned schedule of MobileNet-V2 packs them: 96 output
    channels in two blocks of 64 (the last 32 slots padding), the weight in 16x16 tiles."""

    @I.ir_module
    class Module:
        @T.prim_func(private=True, s_tir=True)
        def pack(bias: T.Buffer((T.int64(96),), "float32"),
                 weight: T.Buffer((T.int64(1), T.int64(1), T.int64(384), T.int64(96)), "float32"),
                 bias_packed: T.Buffer((T.int64(2), T.int64(64)), "float32"),
                 weight_packed: T.Buffer((T.int64(3), T.int64(2), T.int64(24), T.int64(16), T.int64(16)), "float32")):
            T.func_attr({"tirx.noalias": True})
            for ax0 in range(T.int64(96)):
                with T.sblock("bias_packed"):
                    v0 = T.axis.spatial(T.int64(96), ax0)
                    bias_packed[v0 // T.int64(64), v0 % T.int64(64)] = bias[v0]
            for ax0, ax1, ax2, ax3 in T.grid(T.int64(1), T.int64(1), T.int64(384), T.int64(96)):
                with T.sblock("weight_packed"):
                    v0, v1, v2, v3 = T.axis.remap("SSSS", [ax0, ax1, ax2, ax3])
                    weight_packed[v3 // T.int64(32), v3 % T.int64(32) // T.int64(16), v2 // T.int64(16),
                                  v2 % T.int64(16), v3 % T.int64(16)] = weight[v0, v1, v2, v3]

        @R.function
        def main(x: R.Tensor((2, 64), "float32")):
            with R.dataflow():
                packed = R.call_tir(Module.pack, (R.const(BIAS), R.const(WEIGHT)),
                                    out_ty=[R.Tensor((2, 64), "float32"), R.Tensor((3, 2, 24, 16, 16), "float32")])
                bias = packed[0]
                weight = packed[1]
                y = R.add(x, bias)
                z = R.sum(weight)
                R.output(y, z)
            return (y, z)

    return Module


def _expected_packing() -> tuple[np.ndarray, np.ndarray]:
    """The packing written out by hand: weight_packed[a, b, c, d, e] = weight[c * 16 + d, a * 32 + b * 16 + e]."""
    bias = np.zeros(128, dtype="float32")
    bias[:96] = BIAS
    weight = WEIGHT.reshape(24, 16, 3, 2, 16).transpose(2, 3, 0, 1, 4)
    return bias.reshape(2, 64), weight


def _folded(mod):
    from tvm import relax

    return relax.transform.FoldConstant()(weight_packing.fold_weight_packing(mod))


def test_a_packing_folds_to_the_values_fold_constant_computes_and_its_function_goes() -> None:
    import tvm_ffi
    from tvm import relax

    module = _packing_module()
    ours, theirs = _folded(module), relax.transform.FoldConstant()(module)
    assert "pack" not in [gv.name_hint for gv in ours.get_global_vars()]  # FoldConstant leaves it, unused
    assert "pack" in [gv.name_hint for gv in theirs.get_global_vars()]
    assert ours["main"].script() == theirs["main"].script()
    (bias, weight), (their_bias, their_weight) = main_constants(ours), main_constants(theirs)
    expected_bias, expected_weight = _expected_packing()
    assert weight.dtype == expected_weight.dtype and np.array_equal(weight, expected_weight)
    assert np.array_equal(their_weight, expected_weight)
    assert np.array_equal(bias, expected_bias)  # the padding zero
    assert np.array_equal(their_bias.ravel()[:96], BIAS)  # FoldConstant's padding is what memory held
    assert not tvm_ffi.structural_equal(ours, module)


def test_grids_taken_in_chunks_give_the_same_values(monkeypatch) -> None:
    """The weight's 384x96 grid in chunks of 192 points: the 96-long loop whole, the 384-long one in pairs."""
    monkeypatch.setattr(weight_packing, "GRID_CHUNK_POINTS", 200)
    bias, weight = main_constants(_folded(_packing_module()))
    expected_bias, expected_weight = _expected_packing()
    assert np.array_equal(bias, expected_bias) and np.array_equal(weight, expected_weight)


def test_a_grid_of_too_many_chunks_is_left_to_fold_constant(monkeypatch) -> None:
    """In chunks of 50 points the weight's grid takes 768 (the 96-long loop in two, for each of 384)."""
    monkeypatch.setattr(weight_packing, "GRID_CHUNK_POINTS", 50)
    monkeypatch.setattr(weight_packing, "MAX_GRID_CHUNKS", 767)
    module = _packing_module()
    assert "pack" in [gv.name_hint for gv in weight_packing.fold_weight_packing(module).get_global_vars()]


def _single_copy_module(kernel):
    """main() calls `kernel` (8 elements in, 8 out) on the constant 0..7."""
    from tvm import relax

    builder = relax.BlockBuilder()
    kernel_var = builder.add_func(kernel, "kernel")
    with builder.function("main", []):
        with builder.dataflow():
            copied = builder.emit_output(relax.call_tir(
                kernel_var, [relax.const(np.arange(8, dtype="float32"))], relax.TensorType((8,), "float32")))
        builder.emit_func_output(copied)
    return builder.get()


@T.prim_func(private=True, s_tir=True)
def _scaled(a: T.Buffer((T.int64(8),), "float32"), b: T.Buffer((T.int64(8),), "float32")):
    for i in range(T.int64(8)):
        with T.sblock("b"):
            v = T.axis.spatial(T.int64(8), i)
            b[v] = a[v] * T.float32(2)


@T.prim_func(private=True, s_tir=True)
def _written_twice(a: T.Buffer((T.int64(8),), "float32"), b: T.Buffer((T.int64(8),), "float32")):
    for i in range(T.int64(8)):
        with T.sblock("b"):
            v = T.axis.spatial(T.int64(8), i)
            b[v // T.int64(2)] = a[v]


@T.prim_func(private=True, s_tir=True)
def _padded_by_a_branch(a: T.Buffer((T.int64(8),), "float32"), b: T.Buffer((T.int64(8),), "float32")):
    for i in range(T.int64(8)):
        with T.sblock("b"):
            v = T.axis.spatial(T.int64(8), i)
            b[v] = T.if_then_else(v < T.int64(6), a[v], T.float32(0))


@T.prim_func(private=True, s_tir=True)
def _reversed(a: T.Buffer((T.int64(8),), "float32"), b: T.Buffer((T.int64(8),), "float32")):
    for i in range(T.int64(8)):
        with T.sblock("b"):
            v = T.axis.spatial(T.int64(8), i)
            b[T.int64(7) - v] = a[v]


@pytest.mark.parametrize("kernel", [_scaled, _written_twice, _padded_by_a_branch])
def test_what_is_not_a_plain_copy_is_left_to_fold_constant(kernel) -> None:
    """An arithmetic op, an element written twice (which write wins is the loop's order), a padding branch."""
    import tvm_ffi

    module = _single_copy_module(kernel)
    left = weight_packing.fold_weight_packing(module)
    assert "call_tir" in left["main"].script() and tvm_ffi.structural_equal(left, module)


def test_a_copy_with_arithmetic_indices_folds() -> None:
    folded = weight_packing.fold_weight_packing(_single_copy_module(_reversed))
    assert "call_tir" not in folded["main"].script()
    assert np.array_equal(main_constants(folded)[-1], np.arange(8, dtype="float32")[::-1])


@pytest.mark.slow
def test_a_tuned_model_compiles_to_the_same_outputs_with_its_packings_folded_in_numpy(tiny_build, monkeypatch,
                                                                                    tmp_path):
    """The session's tiny build's records (tuned schedules that pack weights): compiled with the packings folded
    here and with FoldConstant folding them, the model gives identical outputs, and only FoldConstant's library
    keeps the packing functions."""
    from edgetune import compile as compiling

    model, relax_mod, target, store = tiny_build_inputs(tiny_build[0])
    folded_copies = []
    evaluate = weight_packing.evaluate_copy
    monkeypatch.setattr(weight_packing, "evaluate_copy", lambda *args: folded_copies.append(evaluate(*args))
                        or folded_copies[-1])
    ours = compiling.compile_model(relax_mod, target, store.database)
    assert folded_copies and all(outputs is not None for outputs in folded_copies)
    monkeypatch.setattr(compiling, "fold_weight_packing", lambda mod: mod)
    theirs = compiling.compile_model(relax_mod, target, store.database)

    outputs = []
    for executable, label in ((ours, "ours"), (theirs, "theirs")):
        library = compiling.export_library(executable, tmp_path / f"{label}.so")
        outputs.append(library_outputs(library, model))
        symbols = [name for name in library.read_bytes().split(b"\0") if name.endswith(b"_weight_prepack")]
        assert bool(symbols) == (label == "theirs")
    assert np.array_equal(outputs[0], outputs[1])
