"""ONNX model source: load a user's file or a zoo model, import it into Relax, fuse it for tuning.

Every model, built-in or not, goes through ONNX so there is one import path to get right.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from edgetune.errors import InputError
from edgetune.frontend.winograd import WinogradPolicy
from edgetune.frontend.zoo import build_zoo_model

_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
}


@dataclass(frozen=True)
class ModelInput:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LoadedModel:
    """An ONNX model with concrete input shapes, and the hash that keys every cache built from it."""

    name: str
    proto: onnx.ModelProto
    inputs: tuple[ModelInput, ...]
    output_names: tuple[str, ...]
    sha256: str

    def sample_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Deterministic inputs, used both to verify against ONNX Runtime and to time the model."""
        rng = np.random.default_rng(seed)
        return {
            i.name: rng.standard_normal(i.shape).astype(i.dtype)
            if i.dtype.startswith("float")
            else rng.integers(0, 10, i.shape).astype(i.dtype)
            for i in self.inputs
        }


def load_model(
    *,
    zoo: str | None,
    onnx_path: Path | None,
    input_shapes: dict[str, list[int]] | None,
) -> LoadedModel:
    """Build the zoo model or read the ONNX file, and pin every input to a concrete shape."""
    if zoo is not None:
        shape = None
        if input_shapes:
            shape = tuple(next(iter(input_shapes.values())))
        proto = build_zoo_model(zoo, shape)
        name = zoo
    elif onnx_path is not None:
        try:
            proto = onnx.load(str(onnx_path))
        except Exception as exc:  # onnx raises several unrelated types for a bad file
            raise InputError(f"{onnx_path}: not a readable ONNX model ({exc})") from exc
        name = onnx_path.stem
    else:
        raise InputError("model: give either 'zoo' or 'onnx'")
    inputs = _concrete_inputs(proto, input_shapes or {}, name)
    outputs = tuple(o.name for o in proto.graph.output)
    digest = hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()
    return LoadedModel(name, proto, inputs, outputs, digest)


def _concrete_inputs(
    proto: onnx.ModelProto, input_shapes: dict[str, list[int]], model_name: str
) -> tuple[ModelInput, ...]:
    initializers = {t.name for t in proto.graph.initializer}
    graph_inputs = [i for i in proto.graph.input if i.name not in initializers]
    known = {i.name for i in graph_inputs}
    problems = [
        f"model.input_shapes.{name}: no such model input; the inputs are {sorted(known)}"
        for name in input_shapes
        if name not in known
    ]
    result = []
    for value in graph_inputs:
        tensor_type = value.type.tensor_type
        dtype = _ONNX_TO_NUMPY.get(tensor_type.elem_type)
        if dtype is None:
            problems.append(f"model '{model_name}': input '{value.name}' has an unsupported element type")
            continue
        if value.name in input_shapes:
            shape = tuple(int(d) for d in input_shapes[value.name])
        else:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
            if any(d is None or d <= 0 for d in dims):
                problems.append(
                    f"model.input_shapes: input '{value.name}' has a dynamic shape {dims}; "
                    f"give it a concrete shape, e.g. input_shapes: {{{value.name}: [1, 3, 224, 224]}}"
                )
                continue
            shape = tuple(int(d) for d in dims)
        result.append(ModelInput(value.name, shape, dtype))
    if problems:
        raise InputError(problems)
    return tuple(result)


def to_relax(model: LoadedModel):  # -> tvm.IRModule (tvm imported lazily: it is slow to load)
    """Import into Relax with the weights bound as constants, so tuned kernels see static shapes."""
    from tvm.relax.frontend.onnx import from_onnx

    shape_dict = {i.name: list(i.shape) for i in model.inputs}
    dtype_dict = {i.name: i.dtype for i in model.inputs}
    try:
        return from_onnx(model.proto, shape_dict=shape_dict, dtype_dict=dtype_dict, keep_params_in_input=False)
    except Exception as exc:  # the importer raises many kinds of errors for unsupported graphs
        raise InputError(f"model '{model.name}': TVM's ONNX importer rejected it: {exc}") from exc


CPU_CONV_LAYOUT = ("NHWC", "HWIO")
"""Data and weight layout of convolutions on CPU targets: channels innermost, so the tuned loops
vectorize over output channels with contiguous loads whatever the stride (measured on this CPU at 32
trials, against NCHW: C2 2.9x, C6 1.3x, C9 2.5x faster kernels; benchmarks/kernels.py --layout)."""


def conv_layout(target) -> tuple[str, str] | None:
    """The (data, weight) layout convolutions are converted to for `target`; None keeps the model's.

    Every LLVM (CPU) target, of any ISA, gets channels-last; GPU targets keep the imported layout.
    """
    return CPU_CONV_LAYOUT if target.kind.name == "llvm" else None


def _lift_clips(mod):
    """Clip as relax maximum/minimum ops instead of the importer's opaque TIR calls.

    TVM's ONNX importer emits Clip (ReLU6 in MobileNets) as calls of generated `topi.maximum` /
    `topi.minimum` functions. Layout conversion cannot see through such a call: it would wrap each in
    transposes and keep it out of the convolution's fused kernel. A call is replaced only where its
    function is structurally the very function the relax op legalizes to, so nothing changes meaning.
    """
    import tvm
    import tvm_ffi
    from tvm import relax, te, topi
    from tvm.relax.expr_functor import PyExprMutator, mutator

    mod = relax.transform.FoldConstant()(mod)  # the importer's NaN-guarded bounds become constants
    call_tir = tvm.ir.Op.get("relax.call_tir")
    ops = ((topi.maximum, relax.op.maximum), (topi.minimum, relax.op.minimum))

    def as_scalar(bound):
        """A one-element constant bound as a scalar: layout conversion passes scalars through, not (1,)."""
        value = bound.value.numpy() if isinstance(bound, tvm.ir.GenericConst) else None
        return bound if value is None or value.shape != (1,) else relax.const(value.reshape(()), str(value.dtype))

    @mutator
    class Lift(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != call_tir or len(call.args[1].fields) != 2:
                return call
            args = call.args[1].fields
            if not all(isinstance(a.ty.shape, relax.ShapeExpr) for a in args):
                return call
            callee = mod[call.args[0]]
            operands = [te.placeholder(list(a.ty.shape.values), a.ty.dtype) for a in args]
            for topi_op, relax_op in ops:
                expected = te.create_prim_func([*operands, topi_op(*operands)]).without_attr("global_symbol")
                if tvm_ffi.structural_equal(callee, expected, map_free_vars=True):
                    return relax_op(args[0], as_scalar(args[1]))
            return call

    lifted = tvm.IRModule(mod.functions, attrs=mod.attrs)
    for gvar, function in mod.functions.items():
        if isinstance(function, relax.Function):
            lifted[gvar] = Lift().visit_expr(function)
    return relax.transform.DeadCodeElimination()(lifted)


def fuse_for_tuning(mod, target, winograd: WinogradPolicy | None = None):
    """Legalize and fuse so MetaSchedule sees the fused kernels (without this it extracts 0 tasks).

    On CPU targets convolutions are first converted to `CPU_CONV_LAYOUT` (relax's ConvertLayout: the
    elementwise ops, pooling and additions around them follow; layout transforms remain only at the
    model's edges and before layout-bound ops such as reshape). With a `winograd` policy, the 3x3
    stride-1 convolutions it picks are then legalized as Winograd convolutions on weights transformed
    at compile time (edgetune/frontend/winograd.py).

    The weights are constants, so each kernel's weight buffers are marked layout-free: MetaSchedule's
    RewriteLayout may then tune the kernel on a weight packed into the layout its loops want, and
    `compile_model` packs the constant once at compile time (measured: 1.2-1.6x faster conv2d and
    matmul kernels at the same trials; see benchmarks/kernels.py --prepack). `compile_model` fuses
    with this very function, so the tuned workloads found here are the ones looked up at compile time.
    """
    import tvm
    from tvm import relax

    layout = conv_layout(target)
    converting = []
    if layout:
        mod = _lift_clips(mod)
        converting = [relax.transform.ConvertLayout({"relax.nn.conv2d": list(layout)})]
    algorithms = {"relax.nn.conv2d": winograd.legalize_conv2d} if layout and winograd else None
    passes = tvm.transform.Sequential(
        converting
        + [
            relax.transform.LegalizeOps(customize_legalize_map=algorithms),
            relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.AttachAttrLayoutFreeBuffers(),
        ]
    )
    with target, tvm.transform.PassContext(opt_level=3):
        return passes(mod)
