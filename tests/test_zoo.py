"""Tests for the built-in model zoo: valid ONNX, runnable, deterministic, sanely scaled."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgetune.errors import InputError
from edgetune.frontend.zoo import ZOO_NAMES, build_zoo_model, default_input_shape

ALLOWED_OPS = {"Conv", "Relu", "Clip", "Add", "MaxPool", "GlobalAveragePool", "Flatten", "Gemm"}
NUM_CLASSES = {"resnet18": 1000, "mobilenet_v2": 1000, "tiny_cnn": 10}


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {name: build_zoo_model(name) for name in ZOO_NAMES}


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = sess.run(["logits"], {"data": x})
    return out


def _param_count(model: onnx.ModelProto) -> int:
    return sum(
        int(np.prod(t.dims)) for t in model.graph.initializer if not t.name.startswith("relu6.")
    )


def test_zoo_names() -> None:
    assert ZOO_NAMES == ("resnet18", "mobilenet_v2", "tiny_cnn")


def test_default_input_shapes() -> None:
    assert default_input_shape("resnet18") == (1, 3, 224, 224)
    assert default_input_shape("mobilenet_v2") == (1, 3, 224, 224)
    assert default_input_shape("tiny_cnn") == (1, 3, 16, 16)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_model_is_valid_onnx(models: dict[str, onnx.ModelProto], name: str) -> None:
    model = models[name]
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version in (8, 9)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.graph.name == name
    assert {n.op_type for n in model.graph.node} <= ALLOWED_OPS
    (inp,) = model.graph.input
    (out,) = model.graph.output
    assert inp.name == "data"
    assert tuple(d.dim_value for d in inp.type.tensor_type.shape.dim) == default_input_shape(name)
    assert out.name == "logits"
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [1, NUM_CLASSES[name]]
    for t in model.graph.initializer:
        assert t.data_type == onnx.TensorProto.FLOAT


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_model_runs_with_sane_logits(models: dict[str, onnx.ModelProto], name: str) -> None:
    x = np.random.default_rng(123).standard_normal(default_input_shape(name)).astype(np.float32)
    logits = _run(models[name], x)
    assert logits.shape == (1, NUM_CLASSES[name])
    assert logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    # Neither vanishing nor exploding through the network.
    assert 1e-2 < float(logits.std()) < 100.0
    assert float(np.abs(logits).max()) < 1000.0


def test_resnet18_topology(models: dict[str, onnx.ModelProto]) -> None:
    model = models["resnet18"]
    ops = [n.op_type for n in model.graph.node]
    # 1 stem + 16 block convs + 3 downsample convs; BN folded away.
    assert ops.count("Conv") == 20
    assert ops.count("Add") == 8
    assert ops.count("MaxPool") == 1
    assert ops.count("Gemm") == 1
    # torchvision's 11,689,512 minus one BN scale per conv channel (BN shift becomes conv bias).
    assert _param_count(model) == 11_684_712
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert onnx.helper.get_attribute_value(gemm.attribute[0]) == 1  # transB


def test_mobilenet_v2_topology(models: dict[str, onnx.ModelProto]) -> None:
    model = models["mobilenet_v2"]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") == 52
    assert ops.count("Add") == 10
    assert ops.count("Clip") == 35
    depthwise = [
        n
        for n in model.graph.node
        if n.op_type == "Conv"
        and any(a.name == "group" and a.i > 1 for a in n.attribute)
    ]
    assert len(depthwise) == 17
    # torchvision's 3,504,872 minus one BN scale per conv channel.
    assert _param_count(model) == 3_487_816


def test_tiny_cnn_is_tiny(models: dict[str, onnx.ModelProto]) -> None:
    ops = [n.op_type for n in models["tiny_cnn"].graph.node]
    assert ops == ["Conv", "Relu", "Conv", "Relu", "GlobalAveragePool", "Flatten", "Gemm"]
    assert _param_count(models["tiny_cnn"]) == (8 * 3 * 9 + 8) + (8 * 8 * 9 + 8) + (10 * 8 + 10)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_build_is_deterministic(name: str) -> None:
    a = build_zoo_model(name).SerializeToString()
    b = build_zoo_model(name).SerializeToString()
    assert a == b


def test_seed_changes_weights_not_structure() -> None:
    a = build_zoo_model("tiny_cnn", seed=0)
    b = build_zoo_model("tiny_cnn", seed=1)
    assert a.SerializeToString() != b.SerializeToString()
    assert [n.SerializeToString() for n in a.graph.node] == [
        n.SerializeToString() for n in b.graph.node
    ]


@pytest.mark.parametrize(
    ("name", "shape"),
    [("tiny_cnn", (2, 3, 32, 40)), ("resnet18", (2, 3, 64, 64)), ("mobilenet_v2", (1, 3, 96, 96))],
)
def test_input_shape_override(name: str, shape: tuple[int, ...]) -> None:
    model = build_zoo_model(name, input_shape=shape)
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    logits = _run(model, x)
    assert logits.shape == (shape[0], NUM_CLASSES[name])
    assert np.all(np.isfinite(logits))


@pytest.mark.parametrize(
    ("shape", "needle"),
    [
        ((1, 3, 16), "4 dims"),
        ((1, 3, 16, 16, 1), "4 dims"),
        ((1, 1, 16, 16), "channel"),
        ((1, 4, 16, 16), "channel"),
        ((0, 3, 16, 16), "positive"),
        ((1, 3, 16, -1), "positive"),
        ((1, 3, 16.0, 16), "integers"),
    ],
)
def test_bad_input_shape_raises(shape: tuple[int, ...], needle: str) -> None:
    with pytest.raises(InputError) as info:
        build_zoo_model("tiny_cnn", input_shape=shape)
    message = str(info.value)
    assert needle in message
    assert "tiny_cnn" in message
    assert info.value.exit_code == 2


@pytest.mark.parametrize("call", [build_zoo_model, default_input_shape])
def test_unknown_name_raises_with_valid_names(call) -> None:
    with pytest.raises(InputError) as info:
        call("resnet50")
    message = str(info.value)
    assert "resnet50" in message
    for name in ZOO_NAMES:
        assert name in message
