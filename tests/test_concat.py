"""Concatenations compile as one copy loop per input (edgetune/frontend/concat.py), and compute what ONNX
Runtime computes: an Inception-style block, a symbolic dimension, an empty input, integer tensors."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
import tvm
from conftest import save_image_model
from onnx import helper, numpy_helper
from tvm import relax

from edgetune.compile import compile_model
from edgetune.frontend.concat import legalize_concat
from edgetune.frontend.onnx import fuse_for_tuning, to_relax
from edgetune.profiles import resolve_profile
from edgetune.tuning.tasks import extract_tasks


def _inception_block(path):
    """Three branches (1x1 conv, 3x3 conv, 3x3 max pool) of a [1, 3, 12, 10] input, joined along channels."""
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(array.astype(np.float32), name) for name, array in (
        ("w1", rng.standard_normal((4, 3, 1, 1))), ("w3", rng.standard_normal((6, 3, 3, 3)) * 0.3))]
    nodes = [
        helper.make_node("Conv", ["data", "w1"], ["branch1"]),
        helper.make_node("Conv", ["data", "w3"], ["branch3"], pads=[1, 1, 1, 1]),
        helper.make_node("MaxPool", ["data"], ["pooled"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]),
        helper.make_node("Concat", ["branch1", "branch3", "pooled"], ["joined"], axis=1),
        helper.make_node("Relu", ["joined"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["logits"]),
    ]
    return save_image_model(path, "inception_block", nodes, [1, 3, 12, 10], 13, initializers)


def test_an_inception_block_joins_its_branches_with_one_copy_per_branch_and_matches_onnx_runtime(tmp_path) -> None:
    model = _inception_block(tmp_path / "block.onnx")
    target = resolve_profile("host", None).tvm_target()
    tasks = extract_tasks(fuse_for_tuning(to_relax(model), target), target)
    (concat,) = [task for task in tasks if "concatenate" in task.name]
    script = concat.mod.script()
    assert script.count('T.sblock("T_concat_') == 3 and "if_then_else" not in script

    executable = compile_model(to_relax(model), target, None)
    vm = relax.VirtualMachine(executable, tvm.cpu(0))
    x = model.sample_inputs()["data"]
    ours = vm["main"](tvm.runtime.tensor(x, tvm.cpu(0))).numpy()
    (reference,) = onnxruntime.InferenceSession(str(tmp_path / "block.onnx")).run(None, {"data": x})
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-4)


def _legalized(tensors: list[relax.Var], axis: int) -> tuple[tvm.IRModule, relax.Function]:
    builder = relax.BlockBuilder()
    with builder.function("main", tensors):
        with builder.dataflow():
            joined = builder.emit_output(relax.op.concat(tensors, axis=axis))
        builder.emit_func_output(joined)
    mod = relax.transform.LegalizeOps(customize_legalize_map={"relax.concat": legalize_concat})(builder.get())
    return mod, mod["main"]


def _run(mod: tvm.IRModule, arrays: list[np.ndarray]) -> np.ndarray:
    executable = tvm.compile(mod, target=tvm.target.Target("llvm"))
    vm = relax.VirtualMachine(executable, tvm.cpu(0))
    return vm["main"](*[tvm.runtime.tensor(a, tvm.cpu(0)) for a in arrays]).numpy()


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_static_concatenations_copy_each_input_into_its_slice(dtype) -> None:
    shapes = [(2, 3, 4), (2, 0, 4), (2, 5, 4)]  # an empty input has no block
    tensors = [relax.Var(f"t{i}", relax.TensorType(shape, dtype)) for i, shape in enumerate(shapes)]
    mod, _ = _legalized(tensors, axis=-2)
    scripts = [f.script() for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(scripts) == 1 and scripts[0].count('T.sblock("T_concat_') == 2
    arrays = [np.arange(np.prod(s)).reshape(s).astype(dtype) for s in shapes]
    np.testing.assert_array_equal(_run(mod, arrays), np.concatenate(arrays, axis=1))


def test_a_symbolic_dimension_keeps_tvms_own_legalization() -> None:
    n = tvm.tirx.Var("n", "int64")
    tensors = [relax.Var("a", relax.TensorType((n, 2), "float32")),
               relax.Var("b", relax.TensorType((n, 3), "float32"))]
    mod, _ = _legalized(tensors, axis=1)
    (script,) = [f.script() for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert 'T.sblock("T_concat")' in script  # TVM's one block over the output
    arrays = [np.ones((3, 2), np.float32), np.zeros((3, 3), np.float32)]
    np.testing.assert_array_equal(_run(mod, arrays), np.concatenate(arrays, axis=1))
