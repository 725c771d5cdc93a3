"""Convolutions are tuned and compiled channels-last on CPU targets (any ISA), as imported on GPUs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import main_constants, save_image_model
from onnx import helper, numpy_helper

from edgetune.frontend.onnx import LoadedModel, fuse_for_tuning, to_relax
from edgetune.profiles import resolve_profile
from edgetune.tuning.tasks import extract_tasks


def _mobile_block(path: Path, low: float = 0.0) -> LoadedModel:
    """conv 3->8, ReLU6 (Clip with initializer bounds), depthwise conv, ReLU6, pooled: a MobileNet block.
    `low`: the Clips' lower bound (NaN: none, as ONNX reads it)."""
    rng = np.random.default_rng(0)

    def init(name: str, array: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(array.astype(np.float32), name)

    initializers = [
        init("w1", rng.standard_normal((8, 3, 3, 3)) * 0.3), init("b1", rng.standard_normal(8) * 0.1),
        init("w2", rng.standard_normal((8, 1, 3, 3)) * 0.3), init("b2", rng.standard_normal(8) * 0.1),
        init("lo", np.array(low)), init("hi", np.array(6.0)),
    ]
    nodes = [
        helper.make_node("Conv", ["data", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], group=8),
        helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["logits"]),
    ]
    return save_image_model(path, "mobile_block", nodes, [1, 3, 16, 20], 8, initializers)


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    return _mobile_block(tmp_path_factory.mktemp("layout") / "block.onnx")


def _conv_inputs(target, model) -> list[tuple[str, tuple[int, ...]]]:
    """Each conv task's name and the shape of its first argument (the activation)."""
    tasks = extract_tasks(fuse_for_tuning(to_relax(model), target), target)
    shapes = []
    for task in tasks:
        if "conv2d" in task.name:
            func = task.mod["main"]
            shapes.append((task.name, tuple(int(d) for d in func.params[0].shape)))
    return shapes


@pytest.mark.parametrize("profile", ["host", "raspberry-pi-4"])
def test_cpu_targets_tune_convolutions_channels_last_with_relu6_fused(block, profile) -> None:
    target = resolve_profile(profile, None).tvm_target()
    convs = _conv_inputs(target, block)
    assert sorted(shape for _, shape in convs) == [(1, 16, 20, 3), (1, 16, 20, 8)]  # N, H, W, C
    names = [t.name for t in extract_tasks(fuse_for_tuning(to_relax(block), target), target)]
    # ReLU6 is fused into its convolution: no kernel of its own, no transposes around it
    assert not [n for n in names if "maximum" in n and "conv2d" not in n], names
    assert all("maximum" in name and "minimum" in name for name, _ in convs), convs


def test_gpu_targets_keep_the_imported_layout(block) -> None:
    target = resolve_profile("a100", None).tvm_target()
    assert sorted(shape for _, shape in _conv_inputs(target, block)) == [(1, 3, 16, 20), (1, 8, 16, 20)]


def test_channels_last_model_computes_what_onnx_runtime_does(block) -> None:
    import tvm

    from edgetune.compile import compile_model
    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import run

    target = resolve_profile("host", None).tvm_target()
    x = block.sample_inputs()
    x["data"] = x["data"] * 8  # reach both clip bounds
    vm = tvm.relax.VirtualMachine(compile_model(to_relax(block), target, None), tvm.cpu())
    ours = run(vm, [x["data"]], tvm.cpu())[0]
    expected = ReferenceRuntime(block)._session(1).run(None, x)[0]
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def test_a_nan_clip_bound_means_unbounded_as_in_onnx_runtime(tmp_path) -> None:
    """The importer guards each Clip bound with where(isnan(bound), -inf, bound); edgetune folds those guards on
    constant bounds in numpy (`_fold_nan_guards`), so a NaN bound must still leave the output unclipped below."""
    import tvm

    from edgetune.compile import compile_model
    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import run

    block = _mobile_block(tmp_path / "nan_low.onnx", low=float("nan"))
    x = block.sample_inputs()
    x["data"] = x["data"] * 8
    vm = tvm.relax.VirtualMachine(compile_model(to_relax(block), resolve_profile("host", None).tvm_target(), None),
                                  tvm.cpu())
    ours = run(vm, [x["data"]], tvm.cpu())[0]
    expected = ReferenceRuntime(block)._session(1).run(None, x)[0]
    assert expected.min() < 0  # the NaN bound clipped nothing below
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def test_constant_clip_bounds_fold_to_what_fold_constant_gives(block, monkeypatch) -> None:
    """Folding the NaN guards in numpy changes how long the import takes, not what it imports."""
    import tvm_ffi

    from edgetune.frontend import onnx as frontend

    folded = to_relax(block)
    assert "isnan" not in folded.script() and "where" not in folded.script()
    monkeypatch.setattr(frontend, "_fold_nan_guards", lambda mod: mod)  # FoldConstant compiles and runs them
    unfolded = to_relax(block)
    assert tvm_ffi.structural_equal(folded, unfolded)
    _assert_same_constants(folded, unfolded)  # structural equality passes a (1,) constant for a 0-d one


def test_constant_reshapes_fold_at_import_to_what_fold_constant_gives(block, monkeypatch) -> None:
    """The importer's bias reshapes (C to 1xCx1x1) are folded in numpy (`_fold_constant_layouts`)."""
    import tvm_ffi

    from edgetune.frontend import onnx as frontend

    folded = to_relax(block)
    monkeypatch.setattr(frontend, "_fold_constant_layouts", lambda mod: mod)  # FoldConstant compiles and runs them
    unfolded = to_relax(block)
    assert tvm_ffi.structural_equal(folded, unfolded)
    assert _assert_same_constants(folded, unfolded) == 8  # two weights, two biases, four Clip bounds


def _assert_same_constants(ours, theirs) -> int:
    """The constants of the two modules' main functions are equal in dtype, shape and value; how many."""
    mine, others = main_constants(ours), main_constants(theirs)
    assert len(mine) == len(others)
    for a, b in zip(mine, others):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and np.array_equal(a, b, equal_nan=True)
    return len(mine)


def test_weight_transposes_fold_to_what_fold_constant_gives(block, monkeypatch) -> None:
    """Layout conversion's transposes of constant weights and biases are folded in numpy
    (`_fold_constant_layouts`): the fused kernels and the constants are the ones FoldConstant gave."""
    import tvm_ffi
    from tvm import relax

    from edgetune.frontend import onnx as frontend

    target = resolve_profile("host", None).tvm_target()
    imported = to_relax(block)

    def kernels(mod) -> list[int]:
        return sorted(tvm_ffi.structural_hash(f.without_attr("global_symbol")) for _, f in mod.functions_items()
                      if not isinstance(f, relax.Function))

    folded = fuse_for_tuning(imported, target)
    monkeypatch.setattr(frontend, "_fold_constant_layouts", lambda mod: mod)  # FoldConstant compiles and runs them
    unfolded = fuse_for_tuning(imported, target)
    assert kernels(folded) == kernels(unfolded)
    assert _assert_same_constants(folded, unfolded) == 4  # two weights, two biases (the bounds are in the kernels)
