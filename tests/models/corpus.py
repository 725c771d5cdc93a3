"""Small ONNX networks with the quirks of real exporters, written with `onnx.helper` at test time.

Each model is tiny (a few KB of random weights) so an untuned build takes seconds, yet holds what the
published networks that once failed to build hold: Dropout (one and two outputs), BatchNorm after a
convolution, an n-ary Sum, initializers listed as graph inputs, an old opset, symbolic dimensions, several
inputs and outputs, int64 token ids into an embedding, a transformer block, grouped and depthwise
convolutions, external weight files, and Shape/Constant subgraphs that fold away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class CorpusModel:
    """A written model and the `input_shapes` its recipe needs (None: its shapes are concrete)."""

    name: str
    path: Path
    input_shapes: dict[str, list[int]] | None = None
    quirks: tuple[str, ...] = field(default_factory=tuple)


class _Weights:
    """Deterministic small random initializers, named in order."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.tensors: list[TensorProto] = []

    def add(self, name: str, shape: list[int], scale: float = 0.3, positive: bool = False) -> str:
        values = self._rng.standard_normal(shape).astype(np.float32) * scale
        if positive:
            values = np.abs(values) + 0.5
        self.tensors.append(numpy_helper.from_array(values, name))
        return name

    def const(self, name: str, values: np.ndarray) -> str:
        self.tensors.append(numpy_helper.from_array(values, name))
        return name


def _model(nodes: list, name: str, inputs: list, outputs: list, weights: _Weights, opset: int,
           ir_version: int = 8) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, weights.tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version,
                              producer_name="edgetune-tests")
    onnx.checker.check_model(model)
    return model


def _float_io(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _conv_bn(w: _Weights, prefix: str, source: str, c_in: int, c_out: int, group: int = 1) -> list:
    """Conv (no bias, as exporters write it before BatchNorm) then BatchNormalization."""
    w.add(f"{prefix}.w", [c_out, c_in // group, 3, 3])
    for part, positive in (("scale", True), ("bias", False), ("mean", False), ("var", True)):
        w.add(f"{prefix}.bn.{part}", [c_out], positive=positive)
    return [
        helper.make_node("Conv", [source, f"{prefix}.w"], [f"{prefix}.conv"], pads=[1, 1, 1, 1], group=group),
        helper.make_node("BatchNormalization", [f"{prefix}.conv"] + [f"{prefix}.bn.{p}" for p in
                         ("scale", "bias", "mean", "var")], [f"{prefix}.bn"], epsilon=1e-5),
    ]


def dropout_bn_net() -> onnx.ModelProto:
    """Conv-BN-ReLU-Dropout twice (the second Dropout also returns its mask, as PyTorch exports it), then a head."""
    w = _Weights(1)
    nodes = _conv_bn(w, "c1", "data", 3, 8) + [helper.make_node("Relu", ["c1.bn"], ["r1"])]
    nodes += [helper.make_node("Dropout", ["r1"], ["d1"])]
    nodes += _conv_bn(w, "c2", "d1", 8, 8) + [helper.make_node("Relu", ["c2.bn"], ["r2"])]
    w.const("ratio", np.array(0.5, np.float32))
    nodes += [helper.make_node("Dropout", ["r2", "ratio"], ["d2", "d2.mask"])]
    nodes += [
        helper.make_node("GlobalAveragePool", ["d2"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"]),
        helper.make_node("Gemm", ["flat", w.add("fc.w", [10, 8]), w.add("fc.b", [10])], ["logits"], transB=1),
    ]
    return _model(nodes, "dropout_bn", [_float_io("data", [1, 3, 16, 16])], [_float_io("logits", [1, 10])], w, 12)


def sum_branches_net() -> onnx.ModelProto:
    """Three convolution branches joined by one n-ary Sum (as older Caffe2/MXNet exports write residuals); one
    branch has its bias and a Caffe-style per-channel Scale as separate Mul and Add by [C, 1, 1] constants."""
    w = _Weights(2)
    nodes = []
    for branch in range(3):
        w.add(f"b{branch}.w", [8, 3, 3, 3])
        w.add(f"b{branch}.b", [8])
        nodes.append(helper.make_node("Conv", ["data", f"b{branch}.w", f"b{branch}.b"], [f"b{branch}"],
                                      pads=[1, 1, 1, 1]))
    nodes[0] = helper.make_node("Conv", ["data", "b0.w"], ["b0.conv"], pads=[1, 1, 1, 1])
    nodes[1:1] = [helper.make_node("Mul", [w.add("b0.scale", [8, 1, 1]), "b0.conv"], ["b0.scaled"]),
                  helper.make_node("Add", ["b0.scaled", w.add("b0.shift", [8, 1, 1])], ["b0"])]
    nodes += [
        helper.make_node("Sum", ["b0", "b1", "b2"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["logits"]),
    ]
    return _model(nodes, "sum_branches", [_float_io("data", [1, 3, 16, 16])], [_float_io("logits", [1, 8])], w, 13)


def old_exporter_net() -> onnx.ModelProto:
    """Opset 7, IR 3: every initializer also listed in graph.input, BatchNormalization-7, Dropout-7 with a ratio
    attribute, Upsample-7 with scales, Reshape taking its shape as an input (the old exporters' style)."""
    w = _Weights(3)
    nodes = _conv_bn(w, "c1", "data", 3, 4)
    nodes[1].attribute.append(helper.make_attribute("spatial", 1))
    w.const("flat_shape", np.array([1, -1], np.int64))
    nodes += [
        helper.make_node("Relu", ["c1.bn"], ["relu"]),
        helper.make_node("Dropout", ["relu"], ["drop"], ratio=0.2),
        helper.make_node("Upsample", ["drop"], ["up"], scales=[1.0, 1.0, 2.0, 2.0], mode="nearest"),
        helper.make_node("MaxPool", ["up"], ["pool"], kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Reshape", ["pool", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", w.add("fc.w", [5, 64]), w.add("fc.b", [5])], ["logits"], transB=1),
    ]
    inputs = [_float_io("data", [1, 3, 8, 8])] + [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in w.tensors
    ]
    return _model(nodes, "old_exporter", inputs, [_float_io("logits", [1, 5])], w, 7, ir_version=3)


def symbolic_batch_net() -> onnx.ModelProto:
    """A convolution net whose batch dimension is symbolic ('batch'): the recipe's input_shapes resolves it."""
    w = _Weights(4)
    nodes = [
        helper.make_node("Conv", ["images", w.add("w", [4, 3, 3, 3]), w.add("b", [4])], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"]),
    ]
    return _model(nodes, "symbolic_batch", [_float_io("images", ["batch", 3, 8, 8])],
                  [_float_io("features", ["batch", 4])], w, 13)


def two_inputs_net() -> onnx.ModelProto:
    """An image and a side vector in; logits and the pooled features out."""
    w = _Weights(5)
    nodes = [
        helper.make_node("Conv", ["image", w.add("w", [6, 3, 3, 3]), w.add("b", [6])], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"]),
        helper.make_node("Concat", ["features", "side"], ["joined"], axis=1),
        helper.make_node("Gemm", ["joined", w.add("fc.w", [3, 10]), w.add("fc.b", [3])], ["logits"], transB=1),
    ]
    inputs = [_float_io("image", [1, 3, 8, 8]), _float_io("side", [1, 4])]
    return _model(nodes, "two_inputs", inputs, [_float_io("logits", [1, 3]), _float_io("features", [1, 6])], w, 13)


def grouped_conv_net() -> onnx.ModelProto:
    """Depthwise (group = channels) and grouped (group = 2) convolutions with ReLU6, MobileNet style."""
    w = _Weights(6)
    nodes = [
        helper.make_node("Conv", ["data", w.add("pw.w", [8, 4, 1, 1]), w.add("pw.b", [8])], ["pw"]),
        helper.make_node("Clip", ["pw", w.const("lo", np.array(0, np.float32)), w.const("hi", np.array(6, np.float32))],
                         ["pw6"]),
        helper.make_node("Conv", ["pw6", w.add("dw.w", [8, 1, 3, 3]), w.add("dw.b", [8])], ["dw"], group=8,
                         pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Conv", ["dw", w.add("gc.w", [8, 4, 3, 3]), w.add("gc.b", [8])], ["gc"], group=2,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["gc"], ["out"]),
    ]
    return _model(nodes, "grouped_conv", [_float_io("data", [1, 4, 12, 12])], [_float_io("out", [1, 8, 6, 6])],
                  w, 13)


def _heads(prefix: str, source: str, perm: list[int]) -> list:
    """[1, S, 16] -> [1, S, 2, 8] -> transposed, the target shape computed by a Shape/Slice/Concat subgraph."""
    return [
        helper.make_node("Reshape", [source, "heads_shape"], [f"{prefix}.split"]),
        helper.make_node("Transpose", [f"{prefix}.split"], [f"{prefix}.heads"], perm=perm),
    ]


def _layer_norm(prefix: str, source: str, w: _Weights) -> list:
    w.add(f"{prefix}.gamma", [16], positive=True)
    w.add(f"{prefix}.beta", [16])
    return [helper.make_node("LayerNormalization", [source, f"{prefix}.gamma", f"{prefix}.beta"], [prefix], axis=-1,
                             epsilon=1e-5)]


def token_transformer() -> onnx.ModelProto:
    """int64 token ids (symbolic sequence length) -> embedding Gather -> one pre-norm transformer block with two
    attention heads; outputs the hidden states (float), the argmax token (int64) and a padding mask (bool)."""
    w = _Weights(7)
    w.add("embedding", [40, 16], scale=1.0)
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["emb"])]
    nodes += [
        helper.make_node("Shape", ["emb"], ["emb_shape"]),
        helper.make_node("Slice", ["emb_shape", w.const("zero", np.array([0], np.int64)),
                                   w.const("two", np.array([2], np.int64))], ["batch_seq"]),
        helper.make_node("Constant", [], ["head_dims"], value=numpy_helper.from_array(np.array([2, 8], np.int64))),
        helper.make_node("Concat", ["batch_seq", "head_dims"], ["heads_shape"], axis=0),
        helper.make_node("Concat", ["batch_seq", w.const("model_dim", np.array([16], np.int64))], ["merged_shape"],
                         axis=0),
    ]
    nodes += _layer_norm("ln1", "emb", w)
    for part in "qkv":
        nodes += [helper.make_node("MatMul", ["ln1", w.add(f"{part}.w", [16, 16])], [f"{part}.mm"]),
                  helper.make_node("Add", [f"{part}.mm", w.add(f"{part}.b", [16])], [part])]
    nodes += _heads("q", "q", [0, 2, 1, 3]) + _heads("k", "k", [0, 2, 3, 1]) + _heads("v", "v", [0, 2, 1, 3])
    nodes += [
        helper.make_node("MatMul", ["q.heads", "k.heads"], ["scores"]),
        helper.make_node("Mul", ["scores", w.const("scale", np.array(8 ** -0.5, np.float32))], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v.heads"], ["context"]),
        helper.make_node("Transpose", ["context"], ["context.t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["context.t", "merged_shape"], ["merged"]),
        helper.make_node("MatMul", ["merged", w.add("o.w", [16, 16])], ["attn"]),
        helper.make_node("Add", ["emb", "attn"], ["res1"]),
    ]
    nodes += _layer_norm("ln2", "res1", w)
    nodes += [
        helper.make_node("MatMul", ["ln2", w.add("ff1.w", [16, 32])], ["ff1"]),
        helper.make_node("Relu", ["ff1"], ["ff1.relu"]),
        helper.make_node("MatMul", ["ff1.relu", w.add("ff2.w", [32, 16])], ["ff2"]),
        helper.make_node("Add", ["res1", "ff2"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", w.add("vocab.w", [16, 40], scale=1.0)], ["vocab_logits"]),
        helper.make_node("ArgMax", ["vocab_logits"], ["next_token"], axis=-1, keepdims=0),
        helper.make_node("Greater", ["ids", w.const("pad_id", np.array(0, np.int64))], ["is_token"]),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "sequence"])
    outputs = [_float_io("hidden", [1, "sequence", 16]),
               helper.make_tensor_value_info("next_token", TensorProto.INT64, [1, "sequence"]),
               helper.make_tensor_value_info("is_token", TensorProto.BOOL, [1, "sequence"])]
    return _model(nodes, "token_transformer", [ids], outputs, w, 17)


def shape_subgraph_net() -> onnx.ModelProto:
    """Flatten written as Shape -> Gather -> Unsqueeze -> Concat -> Reshape, and a Constant-node bias, as
    tracing exporters write them: all of it folds to constants once the input shape is known."""
    w = _Weights(8)
    nodes = [
        helper.make_node("Conv", ["data", w.add("w", [4, 3, 3, 3])], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["conv"], ["conv_shape"]),
        helper.make_node("Gather", ["conv_shape", w.const("axis0", np.array(0, np.int64))], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", w.const("axes", np.array([0], np.int64))], ["batch1"]),
        helper.make_node("Concat", ["batch1", w.const("minus1", np.array([-1], np.int64))], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["conv", "flat_shape"], ["flat"]),
        helper.make_node("Constant", [], ["fc.b"], value=numpy_helper.from_array(np.full([3], 0.1, np.float32))),
        helper.make_node("Gemm", ["flat", w.add("fc.w", [3, 256], scale=0.05), "fc.b"], ["logits"], transB=1),
    ]
    return _model(nodes, "shape_subgraph", [_float_io("data", [1, 3, 8, 8])], [_float_io("logits", [1, 3])], w, 13)


def external_data_net() -> onnx.ModelProto:
    """A small convolution net; `write_corpus` saves its weights to a separate file, as large exports do."""
    w = _Weights(9)
    nodes = _conv_bn(w, "c1", "data", 3, 8) + [
        helper.make_node("Relu", ["c1.bn"], ["relu"]),
        helper.make_node("Conv", ["relu", w.add("c2.w", [4, 8, 1, 1]), w.add("c2.b", [4])], ["out"]),
    ]
    return _model(nodes, "external_data", [_float_io("data", [1, 3, 8, 8])], [_float_io("out", [1, 4, 8, 8])],
                  w, 13)


def preactivation_bn_net() -> onnx.ModelProto:
    """BatchNorm on the input and after a ReLU (pre-activation ResNet style): no convolution to fold it into."""
    w = _Weights(13)
    for prefix, channels in (("bn0", 3), ("bn1", 6)):
        for part, positive in (("scale", True), ("bias", False), ("mean", False), ("var", True)):
            w.add(f"{prefix}.{part}", [channels], positive=positive)
    params = {p: [f"{p}.{part}" for part in ("scale", "bias", "mean", "var")] for p in ("bn0", "bn1")}
    nodes = [
        helper.make_node("BatchNormalization", ["data", *params["bn0"]], ["norm0"]),
        helper.make_node("Relu", ["norm0"], ["act0"]),
        helper.make_node("Conv", ["act0", w.add("w", [6, 3, 3, 3]), w.add("b", [6])], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["act1"]),
        helper.make_node("BatchNormalization", ["act1", *params["bn1"]], ["norm1"]),
        helper.make_node("GlobalAveragePool", ["norm1"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"]),
    ]
    return _model(nodes, "preactivation_bn", [_float_io("data", [1, 3, 8, 8])], [_float_io("features", [1, 6])], w, 15)


def newest_opset_net() -> onnx.ModelProto:
    """A small net at the newest opset the installed onnx package defines (and the IR version it writes)."""
    w = _Weights(12)
    nodes = [
        helper.make_node("Conv", ["data", w.add("w", [4, 3, 3, 3]), w.add("b", [4])], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["features"]),
    ]
    return _model(nodes, "newest_opset", [_float_io("data", [1, 3, 8, 8])], [_float_io("features", [1, 4])], w,
                  onnx.defs.onnx_opset_version(), ir_version=onnx.IR_VERSION)


def dropout_mask_net() -> onnx.ModelProto:
    """Dropout whose mask is a graph output: the node must stay, and TVM's layout conversion cannot follow its
    tuple result, so the model keeps its imported layout (the build says so) and still verifies."""
    w = _Weights(10)
    nodes = [
        helper.make_node("Conv", ["data", w.add("w", [4, 3, 3, 3]), w.add("b", [4])], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Dropout", ["conv"], ["drop", "mask"]),
        helper.make_node("Relu", ["drop"], ["out"]),
    ]
    outputs = [_float_io("out", [1, 4, 8, 8]), helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 4, 8, 8])]
    return _model(nodes, "dropout_mask", [_float_io("data", [1, 3, 8, 8])], outputs, w, 13)


_BUILDERS: dict[str, tuple[Callable[[], onnx.ModelProto], dict[str, list[int]] | None, tuple[str, ...]]] = {
    "dropout_bn": (dropout_bn_net, None, ("dropout", "dropout with mask", "batchnorm after conv")),
    "sum_branches": (sum_branches_net, None, ("n-ary sum",)),
    "old_exporter": (old_exporter_net, None, ("opset 7", "initializers as graph inputs", "upsample")),
    "symbolic_batch": (symbolic_batch_net, {"images": [2, 3, 8, 8]}, ("symbolic batch",)),
    "two_inputs": (two_inputs_net, None, ("two inputs", "two outputs")),
    "token_transformer": (token_transformer, {"ids": [1, 6]}, ("int64 tokens", "transformer", "int/bool outputs")),
    "grouped_conv": (grouped_conv_net, None, ("depthwise conv", "grouped conv")),
    "shape_subgraph": (shape_subgraph_net, None, ("shape subgraph", "constant node")),
    "external_data": (external_data_net, None, ("external data",)),
    "preactivation_bn": (preactivation_bn_net, None, ("batchnorm without a conv before it",)),
    "newest_opset": (newest_opset_net, None, ("newest opset",)),
    "dropout_mask": (dropout_mask_net, None, ("dropout mask output", "layout kept")),
}

CORPUS_NAMES = tuple(_BUILDERS)


def write_model(name: str, directory: Path) -> CorpusModel:
    """Write the corpus model `name` as `<directory>/<name>.onnx` (its weights beside it for external_data)."""
    build, input_shapes, quirks = _BUILDERS[name]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.onnx"
    if name == "external_data":
        onnx.save(build(), path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{name}.weights", size_threshold=0)
    else:
        onnx.save(build(), path)
    return CorpusModel(name, path, input_shapes, quirks)


def write_corpus(directory: Path) -> dict[str, CorpusModel]:
    """Every corpus model, written into `directory`."""
    return {name: write_model(name, directory) for name in CORPUS_NAMES}
