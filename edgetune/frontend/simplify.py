"""Inference-only rewrites of an ONNX graph before TVM imports it.

Real exporters write training-time structure into inference graphs: Dropout nodes (which TVM imports as
a tuple that its layout conversion cannot follow), BatchNormalization after every convolution (kept as
its own kernels, with layout transposes around it), n-ary Sum/Max/Min/Mean (imported as a stack into a
tensor of one more dimension and a reduction, which layout conversion cannot follow either), Constant
nodes, and every initializer listed again as a graph input (exporters before ONNX IR 4). Each rewrite here
keeps the model's inference output; the user's own file is never changed, and ONNX Runtime still runs
the original, so verification checks these rewrites too.

Shape/Constant subgraphs need no rewrite here: once every input has a concrete shape, TVM's importer
evaluates Shape and folds what depends only on constants, and FoldConstant removes the rest.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_VARIADIC = {"Sum": "Add", "Max": "Max", "Min": "Min", "Mean": "Add"}


def default_opset(proto: onnx.ModelProto) -> int:
    """The model's version of the default ONNX operator set."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)


def simplify_for_inference(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A rewritten copy of `proto` and one line per kind of rewrite made, for the build log."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    notes = []
    listed = _drop_initializer_inputs(graph)
    if listed:
        model.ir_version = max(model.ir_version, 4)  # IR 4 lets initializers stay out of the inputs
        notes.append(f"{listed} weights were also listed as graph inputs (an old exporter's habit): "
                     "they stay weights, not inputs of the artifact")
    _constants_to_initializers(graph)
    bypassed = _bypass_weight_identities(graph)
    if bypassed:
        notes.append(f"bypassed {_nodes(bypassed, 'Identity')} over weights (an exporter without constant folding): "
                     "their readers read the weights, so the rewrites below can fold them")
    counts = {
        "Dropout": _remove_dropouts(graph),
        "n-ary": _split_variadic(graph),
        "BatchNormalization": _fold_batchnorms(graph),
    }
    counts["per-channel"] = _fold_channel_affine(graph)
    _drop_unused_initializers(graph)
    if counts["Dropout"]:
        notes.append(f"removed {_nodes(counts['Dropout'], 'Dropout')} (identity at inference)")
    if counts["BatchNormalization"]:
        notes.append(f"folded {_nodes(counts['BatchNormalization'], 'BatchNormalization')} into the preceding "
                     "convolutions' weights and bias")
    if counts["per-channel"]:
        notes.append(f"folded {_nodes(counts['per-channel'], 'per-channel Mul/Add/Sub/Div')} by constants into the "
                     "preceding convolutions' weights and bias")
    if counts["n-ary"]:
        notes.append(f"wrote {_nodes(counts['n-ary'], 'n-ary Sum/Max/Min/Mean')} as chains of two-input ops")
    return model, notes


def _nodes(count: int, op: str) -> str:
    return f"{count} {op} node{'s' if count != 1 else ''}"


def _consumers(graph: onnx.GraphProto) -> dict[str, int]:
    """How many node inputs and graph outputs read each value."""
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    for output in graph.output:
        uses[output.name] = uses.get(output.name, 0) + 1
    return uses


def _drop_initializer_inputs(graph: onnx.GraphProto) -> int:
    initializers = {t.name for t in graph.initializer}
    true_inputs = [i for i in graph.input if i.name not in initializers]
    dropped = len(graph.input) - len(true_inputs)
    if dropped:
        del graph.input[:]
        graph.input.extend(true_inputs)
    return dropped


def _replace_node(graph: onnx.GraphProto, index: int, nodes: list[onnx.NodeProto]) -> None:
    del graph.node[index]
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)


def _constants_to_initializers(graph: onnx.GraphProto) -> None:
    """Constant nodes holding a tensor become initializers, so the rewrites below can read them."""
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
            continue
        if node.attribute[0].name != "value":
            continue
        tensor = onnx.TensorProto()
        tensor.CopyFrom(node.attribute[0].t)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        del graph.node[index]


def _bypass_weight_identities(graph: onnx.GraphProto) -> int:
    """An Identity whose input is a weight (an initializer, or another such Identity) is removed and its readers
    read the weight: PyTorch's exporter without constant folding reads every weight through one, and BatchNorm
    then neither folds into its convolution nor lets the ReLU after it join the convolution's kernel. Nothing
    is copied, however many Identity nodes a weight has. A graph output, or a name a subgraph reads, keeps its
    node. Nodes come in topological order, so a chain of them resolves in the one pass."""
    keep = {o.name for o in graph.output} | _names_read_in_subgraphs(graph)
    weights = {t.name for t in graph.initializer}
    source: dict[str, str] = {}
    removed = []
    for index, node in enumerate(graph.node):
        for position, name in enumerate(node.input):
            if name in source:
                node.input[position] = source[name]
        if (node.op_type == "Identity" and node.domain in ("", "ai.onnx") and node.input[0] in weights
                and node.output[0] not in keep and node.output[0] not in weights):
            source[node.output[0]] = node.input[0]
            removed.append(index)
    for index in reversed(removed):
        del graph.node[index]
    return len(removed)


def _names_read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node inside a subgraph (If, Loop, Scan bodies, at any depth) reads."""
    names: set[str] = set()
    pending = [sub for node in graph.node for sub in _subgraphs(node)]
    while pending:
        sub = pending.pop()
        for node in sub.node:
            names.update(node.input)
            pending.extend(_subgraphs(node))
    return names


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [sub for a in node.attribute for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def _remove_dropouts(graph: onnx.GraphProto) -> int:
    """Dropout becomes Identity (which imports as its input) unless something reads its mask."""
    uses = _consumers(graph)
    removed = 0
    for index, node in enumerate(graph.node):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        if any(uses.get(extra, 0) for extra in node.output[1:] if extra):
            continue
        _replace_node(graph, index, [helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)])
        removed += 1
    return removed


def _split_variadic(graph: onnx.GraphProto) -> int:
    """Sum/Max/Min/Mean of n inputs as a chain of two-input ops (Mean: then divided by n); of one input, as
    Identity."""
    split = 0
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if node.op_type not in _VARIADIC or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.input) == 1:
            _replace_node(graph, index, [helper.make_node("Identity", [node.input[0]], [node.output[0]],
                                                          name=node.name)])
            split += 1
            continue
        if node.op_type != "Mean" and len(node.input) == 2:
            continue
        binary = _VARIADIC[node.op_type]
        final = node.output[0]
        total = f"{final}.sum" if node.op_type == "Mean" else final
        chain, running = [], node.input[0]
        for position, operand in enumerate(node.input[1:], start=1):
            result = total if position == len(node.input) - 1 else f"{final}.partial{position}"
            chain.append(helper.make_node(binary, [running, operand], [result], name=f"{final}.chain{position}"))
            running = result
        if node.op_type == "Mean":
            count = numpy_helper.from_array(np.array(len(node.input), np.float32), f"{final}.count")
            graph.initializer.append(count)
            chain.append(helper.make_node("Div", [total, count.name], [final], name=f"{final}.mean"))
        _replace_node(graph, index, chain)
        split += 1
    return split


def _fold_batchnorms(graph: onnx.GraphProto) -> int:
    """Conv -> BatchNormalization (inference) becomes one Conv with scaled weights and a shifted bias."""
    weights = {t.name: t for t in graph.initializer}
    uses = _consumers(graph)
    producers = {out: node for node in graph.node for out in node.output}
    folded = []
    for bn in graph.node:
        conv = producers.get(bn.input[0]) if bn.op_type == "BatchNormalization" else None
        if conv is None or conv.op_type != "Conv" or uses.get(bn.input[0]) != 1:
            continue
        if not _foldable(bn, conv, weights, uses):
            continue
        scale, shift, mean, var = (numpy_helper.to_array(weights[n]).astype(np.float64) for n in bn.input[1:5])
        epsilon = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        factor = scale / np.sqrt(var + epsilon)
        kernel = numpy_helper.to_array(weights[conv.input[1]])
        bias = numpy_helper.to_array(weights[conv.input[2]]) if len(conv.input) > 2 and conv.input[2] else 0.0
        new_kernel = (kernel.astype(np.float64) * factor.reshape(-1, *[1] * (kernel.ndim - 1))).astype(kernel.dtype)
        new_bias = ((np.asarray(bias, np.float64) - mean) * factor + shift).astype(kernel.dtype)
        names = (f"{bn.output[0]}.folded_weight", f"{bn.output[0]}.folded_bias")
        graph.initializer.extend([numpy_helper.from_array(new_kernel, names[0]),
                                  numpy_helper.from_array(new_bias, names[1])])
        del conv.input[1:]
        conv.input.extend(names)
        conv.output[0] = bn.output[0]
        folded.append(bn)
    for bn in folded:
        graph.node.remove(bn)
    return len(folded)


_AFFINE_OPS = ("Mul", "Div", "Add", "Sub")


def _fold_channel_affine(graph: onnx.GraphProto) -> int:
    """Conv followed by Mul/Div/Add/Sub with a per-channel constant (a Caffe-style Scale, a bias written apart)
    becomes one Conv; repeated, so a chain of them folds. Left in place, TVM's layout conversion cannot follow
    a constant of lower rank ([C, 1, 1]) and wraps each such op in transposes."""
    folded = 0
    while True:
        weights = {t.name: t for t in graph.initializer}
        uses = _consumers(graph)
        producers = {out: node for node in graph.node for out in node.output}
        match = next(((node, conv, constant) for node in graph.node if node.op_type in _AFFINE_OPS
                      and node.domain in ("", "ai.onnx") and len(node.input) == 2
                      for conv, constant in _conv_operand(node, producers, weights, uses)), None)
        if match is None:
            return folded
        node, conv, constant = match
        kernel = numpy_helper.to_array(weights[conv.input[1]])
        bias = numpy_helper.to_array(weights[conv.input[2]]) if len(conv.input) > 2 and conv.input[2] else None
        new_kernel = kernel.astype(np.float64)
        new_bias = np.zeros(kernel.shape[0]) if bias is None else bias.astype(np.float64)
        if node.op_type in ("Mul", "Div"):
            factor = constant if node.op_type == "Mul" else 1.0 / constant
            new_kernel = new_kernel * factor.reshape(-1, *[1] * (kernel.ndim - 1))
            new_bias = new_bias * factor
        else:
            new_bias = new_bias + (constant if node.op_type == "Add" else -constant)
        names = (f"{node.output[0]}.folded_weight", f"{node.output[0]}.folded_bias")
        graph.initializer.extend([numpy_helper.from_array(new_kernel.astype(kernel.dtype), names[0]),
                                  numpy_helper.from_array(new_bias.astype(kernel.dtype), names[1])])
        del conv.input[1:]
        conv.input.extend(names)
        conv.output[0] = node.output[0]
        graph.node.remove(node)
        folded += 1


def _conv_operand(node: onnx.NodeProto, producers: dict, weights: dict, uses: dict[str, int]) -> list[tuple]:
    """[(conv, per-channel constant)] when one operand of `node` is a Conv's output read by nothing else and the
    other a constant that varies along the channel axis only (Sub and Div: the Conv must come first)."""
    positions = (0, 1) if node.op_type in ("Mul", "Add") else (0,)
    for position in positions:
        conv, constant = producers.get(node.input[position]), node.input[1 - position]
        if conv is None or conv.op_type != "Conv" or uses.get(node.input[position]) != 1 or constant not in weights:
            continue
        if not all(name in weights for name in conv.input[1:] if name):
            continue
        kernel = weights[conv.input[1]]
        if kernel.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
            continue
        channels = _per_channel(numpy_helper.to_array(weights[constant]), kernel.dims[0], len(kernel.dims))
        if channels is not None and (node.op_type != "Div" or np.all(channels != 0)):
            return [(conv, channels)]
    return []


def _per_channel(value: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """`value` as one number per output channel, if it broadcasts against [N, C, ...] along C only."""
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if any(size != 1 for axis, size in enumerate(shape) if axis != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.reshape(-1).astype(np.float64), (channels,)).copy()


def _foldable(bn: onnx.NodeProto, conv: onnx.NodeProto, weights: dict, uses: dict[str, int]) -> bool:
    """Inference-mode BatchNorm whose parameters and the conv's weights are all constants."""
    attributes = {a.name: helper.get_attribute_value(a) for a in bn.attribute}
    if attributes.get("training_mode", 0) or attributes.get("spatial", 1) != 1 or len(bn.input) != 5:
        return False
    if any(uses.get(extra, 0) for extra in bn.output[1:] if extra):
        return False
    constant = list(bn.input[1:5]) + [n for n in conv.input[1:] if n]
    return all(name in weights for name in constant) and weights[conv.input[1]].data_type in (
        onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
