"""Built-in models, constructed in code as ONNX ModelProtos.

They exist so that demos, tests and benchmarks need no downloaded weights, yet still take exactly
the same ONNX import path as a user's model file. Weights are deterministic random (He-style init
from ``np.random.default_rng(seed)``), scaled so activations stay in a sane range through the
network; BatchNormalization is treated as already folded into each Conv's weights and bias, as an
exporter would leave an inference graph. Only Conv, Relu, Clip, Add, MaxPool, GlobalAveragePool,
Flatten and Gemm are emitted, which every ONNX importer we target supports.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgetune.errors import InputError

__all__ = ["ZOO_NAMES", "build_zoo_model", "default_input_shape"]

ZOO_NAMES: tuple[str, ...] = ("resnet18", "mobilenet_v2", "tiny_cnn")

# Opset 17 with IR version 8 (the IR version that opset 17 was released with) loads in every
# onnxruntime and TVM we support; newer IR versions are refused by older runtimes.
OPSET = 17
IR_VERSION = 8
INPUT_NAME = "data"
OUTPUT_NAME = "logits"

_DEFAULT_SHAPES: dict[str, tuple[int, ...]] = {
    "resnet18": (1, 3, 224, 224),
    "mobilenet_v2": (1, 3, 224, 224),
    "tiny_cnn": (1, 3, 16, 16),
}

# Scale for the last conv of a residual branch: with unit-gain branches each residual add doubles
# the variance (2**8 after ResNet-18's eight blocks); halving the branch keeps the growth per block
# at 1.25x, so logits stay of order 1-100 for a standard-normal input.
_RESIDUAL_BRANCH_SCALE = 0.5
# Folded-BN biases are small and non-zero, so bias-add is real work for the compiler but does not
# shift activation statistics.
_BIAS_STD = 0.01


def default_input_shape(name: str) -> tuple[int, ...]:
    """NCHW input shape a zoo model is built with when none is given (batch 1)."""
    _check_name(name)
    return _DEFAULT_SHAPES[name]


def build_zoo_model(
    name: str, input_shape: tuple[int, ...] | None = None, seed: int = 0
) -> onnx.ModelProto:
    """Build zoo model `name` as an ONNX model with input "data" and output "logits".

    `input_shape` (NCHW, 3 channels) overrides batch and spatial size; all zoo models end in a
    global average pool, so any positive spatial size works. The same (name, shape, seed) always
    gives a byte-identical model, so tuning logs and caches keyed on it stay valid.
    """
    _check_name(name)
    shape = default_input_shape(name) if input_shape is None else _check_shape(name, input_shape)
    g = _GraphBuilder(np.random.default_rng(seed))
    logits, classes = _BUILDERS[name](g, INPUT_NAME)
    return g.finish(name, shape, logits, classes)


def _check_name(name: str) -> None:
    if name not in _DEFAULT_SHAPES:
        raise InputError(
            f"unknown zoo model {name!r}; valid names: {', '.join(ZOO_NAMES)}"
        )


def _check_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = tuple(input_shape)
    problem = None
    if len(dims) != 4:
        problem = f"must have 4 dims (N, C, H, W), got {len(dims)}"
    elif not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
        problem = "dims must be integers"
    elif dims[1] != 3:
        problem = f"channel dim (index 1) must be 3, got {dims[1]}"
    elif any(d < 1 for d in dims):
        problem = "dims must be positive"
    if problem is not None:
        raise InputError(f"zoo model {name!r}: input_shape {tuple(input_shape)!r} {problem}")
    return tuple(int(d) for d in dims)


class _GraphBuilder:
    """Accumulates nodes and initializers with deterministic names and weights."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._counts: dict[str, int] = {}
        self._relu6_bounds: tuple[str, str] | None = None

    def _name(self, op: str) -> str:
        n = self._counts.get(op, 0)
        self._counts[op] = n + 1
        return f"{op.lower()}_{n}"

    def _init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array, np.float32), name))
        return name

    def _normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: int,
        stride: int = 1,
        group: int = 1,
        relu_follows: bool = True,
        scale: float = 1.0,
    ) -> str:
        """Conv with folded-BN bias; He init (gain 2) if a ReLU follows, else gain 1."""
        name = self._name("Conv")
        fan_in = (cin // group) * k * k
        std = scale * math.sqrt((2.0 if relu_follows else 1.0) / fan_in)
        w = self._init(f"{name}.weight", self._normal((cout, cin // group, k, k), std))
        b = self._init(f"{name}.bias", self._normal((cout,), _BIAS_STD))
        pad = k // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, w, b],
                [name],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[pad, pad, pad, pad],
                group=group,
            )
        )
        return name

    def relu(self, x: str) -> str:
        name = self._name("Relu")
        self.nodes.append(helper.make_node("Relu", [x], [name], name=name))
        return name

    def relu6(self, x: str) -> str:
        """Clip(0, 6) with min/max as initializer inputs (opset 13+ form), shared by all uses."""
        if self._relu6_bounds is None:
            self._relu6_bounds = (
                self._init("relu6.min", np.array(0.0, np.float32)),
                self._init("relu6.max", np.array(6.0, np.float32)),
            )
        name = self._name("Clip")
        self.nodes.append(helper.make_node("Clip", [x, *self._relu6_bounds], [name], name=name))
        return name

    def add(self, a: str, b: str) -> str:
        name = self._name("Add")
        self.nodes.append(helper.make_node("Add", [a, b], [name], name=name))
        return name

    def maxpool(self, x: str, k: int, stride: int, pad: int) -> str:
        name = self._name("MaxPool")
        self.nodes.append(
            helper.make_node(
                "MaxPool",
                [x],
                [name],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[pad, pad, pad, pad],
            )
        )
        return name

    def classifier(self, x: str, features: int, classes: int) -> str:
        """GlobalAveragePool -> Flatten -> Gemm(transB=1) producing the graph output."""
        pool = self._name("GlobalAveragePool")
        self.nodes.append(helper.make_node("GlobalAveragePool", [x], [pool], name=pool))
        flat = self._name("Flatten")
        self.nodes.append(helper.make_node("Flatten", [pool], [flat], name=flat, axis=1))
        fc = self._name("Gemm")
        w = self._init(f"{fc}.weight", self._normal((classes, features), math.sqrt(1.0 / features)))
        b = self._init(f"{fc}.bias", self._normal((classes,), _BIAS_STD))
        self.nodes.append(
            helper.make_node("Gemm", [flat, w, b], [OUTPUT_NAME], name=fc, transB=1)
        )
        return OUTPUT_NAME

    def finish(
        self, name: str, shape: tuple[int, ...], output: str, classes: int
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, list(shape))],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, [shape[0], classes])],
            initializer=self.inits,
        )
        model = helper.make_model(
            graph,
            producer_name="edgetune.zoo",
            opset_imports=[helper.make_opsetid("", OPSET)],
        )
        model.ir_version = IR_VERSION
        model.doc_string = f"edgetune built-in {name} with deterministic random weights"
        return model


def _resnet18(g: _GraphBuilder, x: str) -> tuple[str, int]:
    """torchvision ResNet-18 topology (BasicBlock, [2, 2, 2, 2]) with BN folded into convs."""
    x = g.relu(g.conv(x, 3, 64, 7, stride=2))
    x = g.maxpool(x, 3, 2, 1)
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            y = g.relu(g.conv(x, cin, cout, 3, stride=stride))
            y = g.conv(y, cout, cout, 3, relu_follows=False, scale=_RESIDUAL_BRANCH_SCALE)
            if stride != 1 or cin != cout:
                x = g.conv(x, cin, cout, 1, stride=stride, relu_follows=False)
            x = g.relu(g.add(y, x))
            cin = cout
    return g.classifier(x, 512, 1000), 1000


# MobileNetV2 inverted-residual settings: expansion t, output channels c, repeats n, stride s.
_MBV2_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _mobilenet_v2(g: _GraphBuilder, x: str) -> tuple[str, int]:
    """torchvision MobileNetV2 (width 1.0): ReLU6 as Clip, depthwise as group=C, BN folded."""
    x = g.relu6(g.conv(x, 3, 32, 3, stride=2))
    cin = 32
    for t, c, n, s in _MBV2_SETTINGS:
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            residual = stride == 1 and cin == c
            y = x
            if t != 1:
                y = g.relu6(g.conv(y, cin, hidden, 1))
            y = g.relu6(g.conv(y, hidden, hidden, 3, stride=stride, group=hidden))
            y = g.conv(
                y,
                hidden,
                c,
                1,
                relu_follows=False,
                scale=_RESIDUAL_BRANCH_SCALE if residual else 1.0,
            )
            x = g.add(y, x) if residual else y
            cin = c
    x = g.relu6(g.conv(x, cin, 1280, 1))
    return g.classifier(x, 1280, 1000), 1000


def _tiny_cnn(g: _GraphBuilder, x: str) -> tuple[str, int]:
    """Two convs, pool and a dense layer: a handful of tuning tasks for fast end-to-end tests."""
    x = g.relu(g.conv(x, 3, 8, 3))
    x = g.relu(g.conv(x, 8, 8, 3, stride=2))
    return g.classifier(x, 8, 10), 10


_BUILDERS: dict[str, Callable[[_GraphBuilder, str], tuple[str, int]]] = {
    "resnet18": _resnet18,
    "mobilenet_v2": _mobilenet_v2,
    "tiny_cnn": _tiny_cnn,
}
