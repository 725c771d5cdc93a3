"""Model source: load a user's ONNX file (or a zoo model, or a torch.export program), import it into Relax,
fuse it for tuning.

Every ONNX model, built-in or not, takes one import path: inference-only rewrites first
(frontend/simplify.py), then TVM's importer, then a check that the CPU layout conversion can handle the
result. torch.export programs take TVM's own importer for them (frontend/exported_program.py) and the
same layout check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from edgetune.errors import BuildError, InputError
from edgetune.frontend.model import LoadedModel, ModelInput, quiet, tvm_message
from edgetune.frontend.simplify import default_opset, simplify_for_inference
from edgetune.frontend.winograd import WinogradPolicy
from edgetune.frontend.zoo import build_zoo_model

if TYPE_CHECKING:
    import tvm

_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
}

IMPORT_OPSET = 13
"""Models older than opset 11 are converted to this opset before import: TVM's importer implements most ops
from opset 11-13 on, and the ops that moved attributes to inputs (Upsample, Pad, Slice, Clip) changed before 11."""


def load_model(
    *,
    zoo: str | None,
    onnx_path: Path | None,
    input_shapes: dict[str, list[int]] | None,
    say: Callable[[str], None] = quiet,
    exported_program: Path | None = None,
) -> LoadedModel:
    """Build the zoo model or read the ONNX file (with its external data files), and pin every input to a
    concrete shape. `say` receives the notes of the import that follows (see `to_relax`)."""
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
    elif exported_program is not None:
        from edgetune.frontend.exported_program import load_exported_program

        return load_exported_program(exported_program, input_shapes, say)
    else:
        raise InputError("model: give one of 'zoo', 'onnx' or 'exported_program'")
    inputs = _concrete_inputs(proto, input_shapes or {}, name)
    outputs = tuple(o.name for o in proto.graph.output)
    digest = hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()
    return LoadedModel(name, proto, inputs, outputs, digest, _index_limits(proto, inputs), say, source=onnx_path)


_SAME_VALUES = frozenset({"Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Expand", "Slice",
                          "Cast"})
"""Ops whose output holds (some of) their first input's values, rearranged (a signed integer Cast keeps every value
that fits): token ids reach an embedding through them (GPT-2's exports reshape the ids, Keras' cast them to int32)."""

_SIGNED_INTEGER_TYPES = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32,
                                   onnx.TensorProto.INT64})
"""Casts followed to a Gather. An id in [-N, N) cast to a narrower signed type may wrap, but into the type's range,
which then lies inside [-N, N) or holds the id unwrapped; a cast to an unsigned type would turn -1 into an index
far past the table, so it is not followed (no limit is known there, as for any computed index)."""


def _index_limits(proto: onnx.ModelProto, inputs: tuple[ModelInput, ...]) -> dict[str, int]:
    """For each integer input whose values reach a Gather's indices into a constant table unchanged (directly
    or through `_SAME_VALUES` ops), the table's length. ONNX lists nodes in dependency order, so one pass sees
    every value's source before its users."""
    tables = {t.name: list(t.dims) for t in proto.graph.initializer}
    source_input = {i.name: i.name for i in inputs if i.dtype.startswith(("int", "uint"))}
    limits: dict[str, int] = {}
    for node in proto.graph.node:
        first = node.input[0] if node.input else None
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
            if value is not None:
                tables[node.output[0]] = list(value.dims)
        elif node.op_type in _SAME_VALUES and first in source_input and node.output and _keeps_integers(node):
            source_input[node.output[0]] = source_input[first]
        elif node.op_type == "Identity" and first in tables and node.output:
            tables[node.output[0]] = tables[first]
        elif node.op_type == "Gather" and len(node.input) >= 2 and node.input[1] in source_input and tables.get(first):
            dims = tables[first]
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if -len(dims) <= axis < len(dims) and dims[axis] >= 1:
                name = source_input[node.input[1]]
                limits[name] = min(limits.get(name, dims[axis]), dims[axis])
    return limits


def _keeps_integers(node: onnx.NodeProto) -> bool:
    """False for a Cast to a type other than a signed integer one (`_SIGNED_INTEGER_TYPES`)."""
    return node.op_type != "Cast" or any(a.name == "to" and a.i in _SIGNED_INTEGER_TYPES for a in node.attribute)


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
                spelled = [d.dim_param or "?" if d.dim_value <= 0 else d.dim_value for d in tensor_type.shape.dim]
                example = [d if isinstance(d, int) else 1 for d in spelled]
                problems.append(
                    f"model.input_shapes: input '{value.name}' has symbolic dimensions {spelled}; "
                    f"give it a concrete shape, e.g. input_shapes: {{{value.name}: {example}}}"
                )
                continue
            shape = tuple(int(d) for d in dims)
        result.append(ModelInput(value.name, shape, dtype))
    if problems:
        raise InputError(problems)
    return tuple(result)


def to_relax(model: LoadedModel) -> tvm.IRModule:  # tvm imported lazily: it is slow to load
    """Import into Relax with the weights bound as constants, so tuned kernels see static shapes.

    What TVM imports is a rewritten copy (`prepare_for_import`); the model's own graph stays what ONNX
    Runtime runs as the reference. Every rewrite, and a layout the CPU targets must keep, is told to
    `model.say`.
    """
    from tvm.relax.frontend.onnx import from_onnx

    if model.program is not None:
        from edgetune.frontend.exported_program import program_to_relax

        return _check_layout(_decompose_for_inference(program_to_relax(model)), model.say)
    proto, notes = prepare_for_import(model.proto, model.name)
    for note in notes:
        model.say(note)
    shape_dict = {i.name: list(i.shape) for i in model.inputs}
    dtype_dict = {i.name: i.dtype for i in model.inputs}
    try:
        mod = from_onnx(proto, shape_dict=shape_dict, dtype_dict=dtype_dict, keep_params_in_input=False)
    except Exception as exc:  # the importer raises many kinds of errors for unsupported graphs
        raise InputError(f"model '{model.name}': TVM's ONNX importer failed{_failing_node(exc)}: "
                         f"{tvm_message(exc)}") from exc
    return _check_layout(_decompose_for_inference(mod), model.say)


def _decompose_for_inference(mod):
    """Batch norms that could not be folded into a convolution (after a ReLU, on an input) as elementwise ops
    on constants, which layout conversion follows and FuseOps fuses into the preceding kernel."""
    import tvm
    from tvm import relax

    with tvm.transform.PassContext(opt_level=3):
        decomposed = relax.transform.DecomposeOpsForInference()(mod)
        return relax.transform.FoldConstant()(_fold_constant_layouts(_fold_nan_guards(decomposed)))


_NAN_GUARD_MAX_ELEMENTS = 4096
"""Constants at most this large are folded in numpy by `_fold_nan_guards`; larger ones are left to FoldConstant."""


def _fold_nan_guards(mod):
    """The importer's `where(isnan(bound), -inf or inf, bound)` around every constant Clip bound, evaluated in
    numpy. FoldConstant compiles each such call with LLVM: MobileNet-V2's 35 ReLU6 gave 70 of each, about 8 s of
    its 12-s import on a 2-core Zen 1 VM. Only `isnan` and `where` on small constants are folded, to the values
    FoldConstant would give (both are exact: a test checks a NaN bound against ONNX Runtime)."""
    import numpy as np
    import tvm

    return _fold_in_numpy(mod, {
        tvm.ir.Op.get("relax.isnan"): lambda call, values: np.isnan(values[0]),
        tvm.ir.Op.get("relax.where"): lambda call, values: np.where(*values),
    }, _NAN_GUARD_MAX_ELEMENTS)


def _fold_constant_layouts(mod):
    """Every `permute_dims` and `reshape` of a constant, evaluated in numpy. The importer reshapes each
    convolution's bias (C to 1xCx1x1), layout conversion transposes each weight and bias (OIHW to HWIO), and
    FoldConstant compiled each such op with LLVM and ran it: on a 2-core Zen 1 VM MobileNet-V2's 52 reshapes
    took 3.7 s of its 4.3-s import, and its 104 transposes 7 s of every `fuse_for_tuning` call (task
    extraction, and each compile of the model). Both ops move values and compute nothing: the constants are
    the ones FoldConstant gives. No size bound: the weights are in memory already, and FoldConstant made the
    same copies. A reshape to a shape that is not static is left to FoldConstant."""
    import numpy as np
    import tvm

    def transpose(call, values):
        axes = call.attrs.axes
        return np.transpose(values[0], None if axes is None else [int(a) for a in axes])

    def reshape(call, values):
        shape = call.ty.shape
        dims = getattr(shape, "values", None)
        if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            return None
        return np.reshape(values[0], [int(d) for d in dims])

    return _fold_in_numpy(mod, {tvm.ir.Op.get("relax.permute_dims"): transpose,
                                tvm.ir.Op.get("relax.reshape"): reshape}, None)


def _fold_in_numpy(mod, folds: dict, max_elements: int | None):
    """`mod` with each call of an op in `folds` whose tensor arguments are all constants (or variables bound to
    constants) of at most `max_elements` elements (None: any size) replaced by the constant its numpy function
    (`folds[op](call, values)`) computes, in the call's dtype; a function that returns None leaves the call."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from edgetune.frontend.constants import bound_constant

    @mutator
    class FoldCalls(PyExprMutator):
        def constant(self, expr):
            """`expr`'s value as a numpy array when it is a constant (or a variable bound to one) in bounds."""
            value = bound_constant(expr, self.lookup_binding)
            return value if value is not None and (max_elements is None or value.size <= max_elements) else None

        def visit_call_(self, original):
            call = super().visit_call_(original)
            if call.op not in folds:
                return call
            values = [self.constant(arg) for arg in call.args if not isinstance(arg, relax.ShapeExpr)]
            if any(value is None for value in values):
                return call
            folded = folds[call.op](original, values)
            if folded is None:
                return call
            dtype = str(original.ty.dtype)
            return relax.const(np.array(folded, dtype=dtype, order="C"), dtype)  # 0-d stays 0-d

    folded = tvm.IRModule(mod.functions, attrs=mod.attrs, global_infos=mod.global_infos)
    for gvar, function in mod.functions.items():
        if isinstance(function, relax.Function):
            folded[gvar] = FoldCalls().visit_expr(function)
    return folded


def prepare_for_import(proto: onnx.ModelProto, name: str) -> tuple[onnx.ModelProto, list[str]]:
    """The graph TVM imports: an old opset converted, inference-only rewrites made (frontend/simplify.py),
    and every op checked against the importer's table, so an unsupported one is named before importing."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    notes = []
    opset = default_opset(proto)
    if opset < 11:
        from onnx import version_converter

        try:
            proto = version_converter.convert_version(proto, IMPORT_OPSET)
            notes.append(f"opset {opset} converted to opset {IMPORT_OPSET} with onnx.version_converter "
                         "(TVM's importer implements the older forms of several ops differently)")
        except Exception as exc:  # the converter lacks adapters for some ops; the importer may still cope
            notes.append(f"opset {opset} kept: onnx.version_converter could not convert it ({tvm_message(exc)})")
    proto, rewrites = simplify_for_inference(proto)
    supported = _get_convert_map()
    unsupported = sorted({f"{n.op_type} (node '{n.name or n.output[0]}')" for n in proto.graph.node
                          if n.domain in ("", "ai.onnx") and n.op_type not in supported})
    if unsupported:
        raise InputError(f"model '{name}': TVM's ONNX importer has no conversion for the ONNX op "
                         f"{', '.join(unsupported)}")
    return proto, notes + rewrites


def _failing_node(exc: BaseException) -> str:
    """' on ONNX node X (op Y)' when the importer's traceback shows which node it was converting."""
    traceback = exc.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        node = frame.f_locals.get("node") if frame.f_code.co_name == "_construct_nodes" else None
        if isinstance(node, onnx.NodeProto):
            return f" on ONNX node '{node.name or node.output[0]}' (op {node.op_type})"
        traceback = traceback.tb_next
    return ""


KEEP_LAYOUT_ATTR = "edgetune_keep_layout"
"""Module attribute set by `to_relax` when layout conversion fails: why the model keeps its layout."""


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
    `mod` is `to_relax`'s: the importer's NaN-guarded bounds are constants already (`_decompose_for_inference`).
    """
    import tvm
    import tvm_ffi
    from tvm import relax, te, topi
    from tvm.relax.expr_functor import PyExprMutator, mutator

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


def _check_layout(mod, say: Callable[[str], None]):
    """Try the CPU targets' layout conversion once, here: a model it cannot convert (ops it cannot follow
    through, whatever real graphs hold) keeps its imported layout on every target, and the build says so."""
    import tvm
    from tvm import relax

    if not _has_conv2d(mod):
        return mod
    try:
        with tvm.transform.PassContext(opt_level=3):
            relax.transform.ConvertLayout({"relax.nn.conv2d": list(CPU_CONV_LAYOUT)})(_lift_clips(mod))
    except Exception as exc:  # TVM's InternalError, raised from C++ checks
        why = f"TVM's ConvertLayout pass failed{_ops_named(exc) or _tuple_ops(mod)}: {tvm_message(exc)}"
        say(f"the model keeps its imported layout on CPU targets (no {CPU_CONV_LAYOUT[0]} conversion): {why}")
        return mod.with_attr(KEEP_LAYOUT_ATTR, why)
    return mod


def _has_conv2d(mod) -> bool:
    import tvm
    from tvm import relax

    conv2d = tvm.ir.Op.get("relax.nn.conv2d")
    found = []
    for function in mod.functions.values():
        if isinstance(function, relax.Function):
            relax.analysis.post_order_visit(
                function, lambda e: found.append(e) if isinstance(e, relax.Call) and e.op == conv2d else None)
    return bool(found)


def _tuple_ops(mod) -> str:
    """' on relax.x (tuple result)' for the ops with several results, which layout conversion cannot follow."""
    from tvm import relax

    ops: set[str] = set()
    for function in mod.functions.values():
        if isinstance(function, relax.Function):
            relax.analysis.post_order_visit(function, lambda e: ops.add(e.op.name) if isinstance(e, relax.Call) and
                                            isinstance(e.ty, relax.TupleType) and
                                            hasattr(e.op, "name") else None)
    return f" on {', '.join(sorted(ops))} (an op with several results)" if ops else ""


def _ops_named(exc: BaseException) -> str:
    """' on relax.x' for the relax ops a TVM error message names."""
    import re

    ops = sorted(set(re.findall(r"\brelax\.[a-z_][a-z0-9_.]*[a-z0-9_]", str(exc))))
    return f" on {', '.join(ops)}" if ops else ""


def _run_passes(mod, passes: list):
    """Run each pass in turn, so a failure names the pass (and the ops TVM names) in edgetune's words."""
    for each in passes:
        try:
            mod = each(mod)
        except Exception as exc:  # TVM's InternalError and friends
            raise BuildError(f"TVM's {each.info.name} pass failed{_ops_named(exc)} while preparing the model's "
                             f"kernels: {tvm_message(exc)}") from exc
    return mod


def fuse_for_tuning(mod: tvm.IRModule, target: tvm.target.Target,
                    winograd: WinogradPolicy | None = None) -> tvm.IRModule:
    """Legalize and fuse so MetaSchedule sees the fused kernels (without this it extracts 0 tasks).

    On CPU targets convolutions are first converted to `CPU_CONV_LAYOUT` (relax's ConvertLayout: the
    elementwise ops, pooling and additions around them follow; layout transforms remain only at the
    model's edges and before layout-bound ops such as reshape), unless `to_relax` found that the model
    cannot be converted (KEEP_LAYOUT_ATTR), or a later pass fails on the converted model: then the model
    is fused in its imported layout, the same way on every call. With a `winograd` policy, the 3x3
    stride-1 convolutions it picks are then legalized as Winograd convolutions on weights transformed
    at compile time (edgetune/frontend/winograd.py).

    The weights are constants, so each kernel's weight buffers are marked layout-free: MetaSchedule's
    RewriteLayout may then tune the kernel on a weight packed into the layout its loops want, and
    `compile_model` packs the constant once at compile time (measured: 1.2-1.6x faster conv2d and
    matmul kernels at the same trials; see benchmarks/kernels.py --prepack). `compile_model` fuses
    with this very function, so the tuned workloads found here are the ones looked up at compile time.
    """
    import tvm

    layout = conv_layout(target)
    if layout and mod.attrs is not None and KEEP_LAYOUT_ATTR in mod.attrs:
        layout = None
    with target, tvm.transform.PassContext(opt_level=3):
        if not layout:
            return _run_passes(mod, _fusion_passes(None, None))
        try:
            return _run_passes(_lift_clips(mod), _fusion_passes(layout, winograd))
        except BuildError:  # the converted model trips a later pass: the imported layout may not
            return _run_passes(mod, _fusion_passes(None, None))


def _fusion_passes(layout: tuple[str, str] | None, winograd: WinogradPolicy | None) -> list:
    import tvm
    from tvm import relax

    from edgetune.frontend.concat import legalize_concat

    converting = [relax.transform.ConvertLayout({"relax.nn.conv2d": list(layout)}),
                  tvm.transform.module_pass(lambda mod, _ctx: _fold_constant_layouts(mod), opt_level=0,
                                            name="FoldConstantLayouts")] if layout else []
    algorithms = {"relax.concat": legalize_concat} if layout else {}
    if layout and winograd:
        algorithms["relax.nn.conv2d"] = winograd.legalize_conv2d
    return converting + [
        relax.transform.LegalizeOps(customize_legalize_map=algorithms),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.AttachAttrLayoutFreeBuffers(),
    ]
