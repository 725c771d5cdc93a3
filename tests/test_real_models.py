"""What real exporters produce imports, builds untuned and verifies against ONNX Runtime.

The corpus (tests/models/corpus.py) holds the quirks of published networks that once failed to build:
Dropout (tuples in TVM), n-ary Sum (a 5-D stack), initializers listed as inputs, opset 7, symbolic
dimensions, several inputs and outputs, int64 token ids with int and bool outputs, grouped convolutions,
external weight files, Shape/Constant subgraphs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from conftest import run_edgetune
from models.corpus import CORPUS_NAMES, CorpusModel, write_corpus

from edgetune.frontend.onnx import load_model, prepare_for_import


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, CorpusModel]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _recipe(directory: Path, model: CorpusModel, input_shapes: dict | None, tuning: dict | None = None,
            file_name: str = "recipe.yaml") -> Path:
    """A recipe building `model` for this machine, untuned unless `tuning` says otherwise (JSON is YAML: names
    go in as data); its artifact spins, so its build times the model one way (1.4 s less per model)."""
    spec: dict = {"onnx": str(model.path)}
    if input_shapes:
        spec["input_shapes"] = input_shapes
    recipe = {"name": model.name.replace("_", "-"), "model": spec, "fleet": [{"name": "host", "profile": "host"}],
              "tuning": tuning or {"trials_per_task": 0, "in_model_candidates": 1}, "output": "out",
              "package": {"thread_wait": "spin"}}  # timed one way: how the threads wait is tested elsewhere
    path = directory / file_name
    path.write_text(json.dumps(recipe))
    return path


def _ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("name", ["dropout_bn", "sum_branches", "old_exporter", "token_transformer"])
def test_rewrites_before_import_keep_the_output(corpus, name) -> None:
    """Dropout removed, BatchNorm folded, Sum chained, old opset converted: ONNX Runtime gives the same output."""
    model = load_model(zoo=None, onnx_path=corpus[name].path, input_shapes=corpus[name].input_shapes)
    rewritten, notes = prepare_for_import(model.proto, model.name)
    ops = {n.op_type for n in rewritten.graph.node}
    assert not ops & {"Dropout", "BatchNormalization", "Sum", "Upsample"}
    assert [i.name for i in rewritten.graph.input] == [i.name for i in model.inputs]
    feeds = model.sample_inputs()
    for ours, theirs in zip(_ort(rewritten, feeds), _ort(model.proto, feeds), strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    if name == "sum_branches":  # the per-channel scale and shift went into the convolution
        assert "Mul" not in ops and any("folded 2 per-channel Mul/Add/Sub/Div nodes" in n for n in notes)
    if name == "old_exporter":
        assert any("opset 7 converted to opset 13" in n for n in notes)
        assert any("8 weights were also listed as graph inputs" in n for n in notes)


def test_batchnorm_and_dropout_leave_no_kernel_of_their_own(corpus) -> None:
    """Conv -> BatchNorm -> ReLU -> Dropout is one fused kernel (conv2d, bias add, relu), twice."""
    from edgetune.frontend.onnx import fuse_for_tuning, to_relax
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.tasks import extract_tasks

    target = resolve_profile("host", None).tvm_target()
    model = load_model(zoo=None, onnx_path=corpus["dropout_bn"].path, input_shapes=None)
    names = [task.name for task in extract_tasks(fuse_for_tuning(to_relax(model), target), target)]
    convolutions = [n for n in names if "conv2d" in n]
    assert len(convolutions) == 2 and all("_add_relu" in n for n in convolutions), names
    assert not [n for n in names if "batch_norm" in n or "dropout" in n or "divide" in n or "sqrt" in n], names


def test_a_batchnorm_without_a_convolution_before_it_fuses_into_its_neighbours(corpus) -> None:
    """Decomposed for inference, BatchNorm after a ReLU joins the convolution's kernel; no batch_norm kernel."""
    from edgetune.frontend.onnx import fuse_for_tuning, to_relax
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.tasks import extract_tasks

    target = resolve_profile("host", None).tvm_target()
    model = load_model(zoo=None, onnx_path=corpus["preactivation_bn"].path, input_shapes=None)
    names = [task.name for task in extract_tasks(fuse_for_tuning(to_relax(model), target), target)]
    assert not [n for n in names if "batch_norm" in n], names
    assert [n for n in names if "conv2d" in n and "relu" in n and "multiply" in n], names


def test_token_ids_are_sampled_inside_the_vocabulary(corpus) -> None:
    model = load_model(zoo=None, onnx_path=corpus["token_transformer"].path, input_shapes={"ids": [1, 64]})
    assert model.index_limits == {"ids": 40}
    ids = model.sample_inputs()["ids"]
    assert ids.dtype == np.int64 and ids.max() >= 10 and ids.max() < 40


def _gather_net(tmp_path: Path, index_nodes: list, index: str, table_nodes: list, table: str) -> Path:
    """int64 ids [1, 6] -> `index_nodes` -> a Gather from `table` (a 40 x 4 initializer, or what `table_nodes`
    make) and one more, straight from the ids, from an 80-row initializer."""
    from onnx import TensorProto, helper, numpy_helper

    rows = numpy_helper.from_array(np.ones((40, 4), np.float32), "rows")
    wide = numpy_helper.from_array(np.ones((80, 4), np.float32), "wide")
    shape = numpy_helper.from_array(np.array([6], np.int64), "flat")
    nodes = [*index_nodes, *table_nodes, helper.make_node("Gather", [table, index], ["picked"]),
             helper.make_node("Gather", ["wide", "ids"], ["direct"])]
    graph = helper.make_graph(
        nodes, "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6])],
        [helper.make_tensor_value_info("picked", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("direct", TensorProto.FLOAT, [1, 6, 4])], [rows, wide, shape])
    path = tmp_path / f"gather{len(list(tmp_path.iterdir()))}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_ids_that_reach_an_embedding_through_a_reshape_or_an_integer_cast_get_its_table_length(tmp_path) -> None:
    """GPT-2's exports reshape the token ids before the embedding's Gather, Keras' cast them to int32: the ids still
    index the table, so the artifact must check them. A computed index (ids + 1), a float or an unsigned cast is not
    followed."""
    from onnx import TensorProto, helper, numpy_helper

    reshape_cast = [helper.make_node("Reshape", ["ids", "flat"], ["flat_ids"]),
                    helper.make_node("Cast", ["flat_ids"], ["ids32"], to=TensorProto.INT32)]
    constant_table = [helper.make_node("Constant", [], ["table"],
                                       value=numpy_helper.from_array(np.ones((30, 4), np.float32)))]
    tied_table = [helper.make_node("Identity", ["rows"], ["tied"])]
    unsqueezed = [helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array([0], np.int64))),
                  helper.make_node("Unsqueeze", ["ids", "zero"], ["ids3"])]
    plus_one = [helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1, np.int64))),
                helper.make_node("Add", ["ids", "one"], ["shifted"])]
    cases = {
        "reshape and int32 cast": (reshape_cast, "ids32", [], "rows", {"ids": 40}),
        "a Constant node's table": (reshape_cast, "ids32", constant_table, "table", {"ids": 30}),
        "a table behind an Identity": ([], "ids", tied_table, "tied", {"ids": 40}),
        "an Unsqueeze": (unsqueezed, "ids3", [], "rows", {"ids": 40}),
        "a computed index": (plus_one, "shifted", [], "rows", {"ids": 80}),
    }
    for case, (index_nodes, index, table_nodes, table, expected) in cases.items():
        path = _gather_net(tmp_path, index_nodes, index, table_nodes, table)
        assert load_model(zoo=None, onnx_path=path, input_shapes=None).index_limits == expected, case
    for through in (TensorProto.FLOAT, TensorProto.UINT32):  # -1 as uint32 would index far past the table
        round_trip = [helper.make_node("Cast", ["ids"], ["ids_other"], to=through),
                      helper.make_node("Cast", ["ids_other"], ["ids_back"], to=TensorProto.INT64)]
        path = _gather_net(tmp_path, round_trip, "ids_back", [], "rows")
        assert load_model(zoo=None, onnx_path=path, input_shapes=None).index_limits == {"ids": 80}, through


def test_a_symbolic_dimension_without_input_shapes_is_named(corpus, tmp_path) -> None:
    run = run_edgetune("build", str(_recipe(tmp_path, corpus["symbolic_batch"], None)), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "recipe.yaml" in run.stderr and "input 'images'" in run.stderr and "input_shapes" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_an_op_without_importer_is_named_before_importing(tmp_path) -> None:
    from onnx import TensorProto, helper

    node = helper.make_node("Col2Im", ["x", "size", "block"], ["y"], name="fold_back")
    graph = helper.make_graph([node], "col2im", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])],
                              [helper.make_tensor("size", TensorProto.INT64, [2], [4, 4]),
                               helper.make_tensor("block", TensorProto.INT64, [2], [2, 2])])
    path = tmp_path / "col2im.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    model = CorpusModel("col2im", path)
    run = run_edgetune("build", str(_recipe(tmp_path, model, None)), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no conversion for the ONNX op Col2Im (node 'fold_back')" in run.stderr
    assert "Traceback" not in run.stderr


def test_an_importer_failure_names_the_onnx_node_and_op(tmp_path) -> None:
    """TopK with a k computed at run time: TVM's importer needs a constant; the error says where, in our words."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["values", "indices"], name="pick_best")], "topk",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                               helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, None)])
    path = tmp_path / "topk.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    run = run_edgetune("build", str(_recipe(tmp_path, CorpusModel("topk", path), None)), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "TVM's ONNX importer failed on ONNX node 'pick_best' (op TopK): TopK k must be a constant" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.fixture(scope="module")
def untuned_release(corpus, tmp_path_factory) -> tuple[Path, str]:
    """Every corpus model but dropout_mask built untuned for this machine in one release command (one TVM start
    instead of one per model); dropout_mask, whose build names a kept layout, is built on its own."""
    directory = tmp_path_factory.mktemp("corpus-release")
    recipes = []
    for name in CORPUS_NAMES:
        if name != "dropout_mask":
            model = corpus[name]
            recipes.append(str(_recipe(directory, model, model.input_shapes, file_name=f"{name}.yaml")))
    run = run_edgetune("build", *recipes, cwd=directory, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
    return directory, run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_each_corpus_model_builds_untuned_and_verifies(corpus, untuned_release, name, tmp_path) -> None:
    """Only true inputs become the artifact's inputs, at the shapes given; the output matches ONNX Runtime."""
    model = corpus[name]
    directory, output = untuned_release
    if name == "dropout_mask":
        run = run_edgetune("build", str(_recipe(tmp_path, model, model.input_shapes)), cwd=tmp_path, timeout=600)
        assert run.returncode == 0, run.stdout + run.stderr
        directory, output = tmp_path, run.stdout
        assert "keeps its imported layout on CPU targets" in output and "relax.nn.dropout" in output
    else:
        assert "keeps its imported layout" not in output
    summary = directory / "out" / model.name.replace("_", "-") / "summary.json"
    host = json.loads(summary.read_text())["targets"]["host"]
    assert host["verified"] is True and host["verification"] == "matched"
    artifact = Path(host["artifact_dir"])
    manifest = json.loads((artifact / "manifest.json").read_text())
    graph = onnx.load(str(model.path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    assert [i["name"] for i in manifest["model"]["inputs"]] == [i.name for i in graph.input if i.name not in weights]
    if model.input_shapes:
        assert {i["name"]: i["shape"] for i in manifest["model"]["inputs"]} == model.input_shapes
    if name == "token_transformer":
        _assert_exact_integer_outputs(artifact)


@pytest.mark.slow
@pytest.mark.parametrize("search", ["draft-verify", "evolutionary"])
def test_a_transformer_block_tunes_with_either_search_and_no_task_raises(corpus, search, tmp_path) -> None:
    """The tasks of a transformer block (softmax, layernorm, batch matmul, transposes: no tunable decision in
    several) are tuned under a small budget without a task failing, and the tuned model compiles: a record
    tuned on `matmul` and offered to `matmul + add` (same anchor block) that does not replay there leaves that
    kernel unscheduled instead of failing the build (edgetune/compile.py, unreplayable_kernels)."""
    model = corpus["token_transformer"]
    tuning = {"trials_per_task": 2, "time_budget_min": 1, "search": search, "max_tasks": 4, "in_model_candidates": 1}
    run = run_edgetune("build", str(_recipe(tmp_path, model, model.input_shapes, tuning)), "--strict", "--json",
                       "summary.json", cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    host = json.loads((tmp_path / "summary.json").read_text())["targets"]["host"]
    assert host["verified"] is True and host["tuning_failed"] == []
    assert host["trials_measured"] > 0 and all(task["tuning_failed"] is None for task in host["tasks"])


def _assert_exact_integer_outputs(artifact: Path) -> None:
    """The argmax token (int64) and padding mask (bool) ship with their dtypes and match ONNX Runtime exactly."""
    import tvm

    from edgetune.runtime import load_library
    from edgetune.runtime import run as run_library

    with np.load(artifact / "sample_input.npz") as inputs, np.load(artifact / "reference_output.npz") as expected:
        outputs = run_library(load_library(artifact / "model.so", tvm.cpu()), [inputs["ids"]], tvm.cpu())
        assert expected["next_token"].dtype == np.int64 and expected["is_token"].dtype == np.bool_
        assert outputs[1].dtype == np.int64 and outputs[2].dtype == np.bool_
        np.testing.assert_array_equal(outputs[1], expected["next_token"])
        np.testing.assert_array_equal(outputs[2], expected["is_token"])


def test_load_model_names_each_symbolic_dimension(corpus) -> None:
    from edgetune.errors import InputError

    with pytest.raises(InputError, match=r"input 'images' has symbolic dimensions \['batch', 3, 8, 8\]"):
        load_model(zoo=None, onnx_path=corpus["symbolic_batch"].path, input_shapes=None)


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


_GPT2_LIKE_EXPORT = """
import sys, torch
class Gpt2Like(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.tte = torch.nn.Embedding(40, 8), torch.nn.Embedding(16, 8), torch.nn.Embedding(2, 8)
        self.head = torch.nn.Linear(8, 40)
    def forward(self, input_ids, token_type_ids):
        ids = input_ids.view(-1, input_ids.size(-1))
        positions = torch.arange(0, input_ids.size(-1), dtype=torch.long).unsqueeze(0)
        return self.head(self.wte(ids) + self.wpe(positions) + self.tte(token_type_ids.to(torch.int32)))
example = (torch.zeros(1, 6, dtype=torch.int64), torch.zeros(1, 6, dtype=torch.int64))
torch.onnx.export(Gpt2Like().eval(), example, sys.argv[1], input_names=["input_ids", "token_type_ids"],
                  output_names=["logits"], opset_version=14, dynamo=False)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _has_torch(), reason="PyTorch is not installed (pip install 'edgetune[torch]')")
def test_a_torch_onnx_export_of_gpt2s_embedding_gets_both_table_lengths(tmp_path) -> None:
    """PyTorch's ONNX exporter writes GPT-2's `input_ids.view(-1, n)` as a Reshape before the Gather and an int32
    cast as a Cast: neither input had a table length before, so their artifacts checked no id."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-W", "ignore", "-c", _GPT2_LIKE_EXPORT, str(tmp_path / "gpt2.onnx")],
                   check=True, timeout=300)
    model = load_model(zoo=None, onnx_path=tmp_path / "gpt2.onnx", input_shapes=None)
    assert model.index_limits == {"input_ids": 40, "token_type_ids": 2}
    assert model.sample_inputs()["token_type_ids"].max() < 2


_EXPORT_SCRIPT = """
import sys, torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.3)
        self.tokens = torch.nn.Embedding(50, 4)
        self.positions = torch.nn.Embedding(30, 4)
        self.head = torch.nn.Linear(4, 5)
    def forward(self, image, ids):
        features = self.drop(torch.relu(self.norm(self.conv(image)))).mean((2, 3))
        looked_up = self.tokens(ids) + self.positions(ids.view(-1, ids.shape[-1]).to(torch.int32))
        logits = self.head(features + looked_up.mean(1))
        return logits, logits.argmax(-1)
torch.manual_seed(0)
net = Net().eval()
net.norm.running_mean.uniform_(-0.5, 0.5)
net.norm.running_var.uniform_(0.5, 1.5)
example = (torch.randn(1, 3, 8, 8), torch.zeros(1, 6, dtype=torch.int64))
torch.export.save(torch.export.export(net, example), sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.skipif(not _has_torch(), reason="PyTorch is not installed (pip install 'edgetune[torch]'): "
                                             "the exported_program path is not tested here")
def test_a_torch_export_program_builds_and_matches_pytorch(tmp_path) -> None:
    """A program saved by torch.export.save (conv, batch norm, dropout, token ids into two embeddings, one through a
    view and an int32 cast; a float and an int64 output) builds and matches PyTorch; token ids are sampled inside
    the smaller table. Its run.py refuses ids outside [0, 30): TVM's take would read a negative one before the
    table, where ONNX's Gather counts it from the end and PyTorch refuses it."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _EXPORT_SCRIPT, str(tmp_path / "net.pt2")], check=True, timeout=300)
    recipe = {"name": "exported", "model": {"exported_program": "net.pt2"},
              "fleet": [{"name": "host", "profile": "host"}], "tuning": {"trials_per_task": 0}, "output": "out"}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    run = run_edgetune("build", "recipe.yaml", "--json", "summary.json", cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    host = json.loads((tmp_path / "summary.json").read_text())["targets"]["host"]
    assert host["verified"] is True
    manifest = json.loads((Path(host["artifact_dir"]) / "manifest.json").read_text())
    assert manifest["model"]["inputs"] == [{"name": "image", "shape": [1, 3, 8, 8], "dtype": "float32"},
                                           {"name": "ids", "shape": [1, 6], "dtype": "int64"}]
    assert len(manifest["model"]["outputs"]) == 2
    artifact = Path(host["artifact_dir"])
    with np.load(artifact / "sample_input.npz") as samples:
        assert samples["ids"].max() >= 10 and samples["ids"].max() < 30
        image = samples["image"]
    assert [(i["index_from"], i["index_limit"]) for i in json.loads((artifact / "io.json").read_text())["inputs"]] \
        == [(None, None), (0, 30)]
    assert "ids into a table of 30 rows" in (artifact / "README.md").read_text()
    for token, code in ((-1, 2), (30, 2), (29, 0), (0, 0)):
        np.savez(tmp_path / "in.npz", image=image, ids=np.array([[1, 2, token, 4, 5, 6]], dtype=np.int64))
        run = subprocess.run([sys.executable, str(artifact / "run.py"), "--input", str(tmp_path / "in.npz"),
                              "--output", str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=120,
                             check=False)
        assert run.returncode == code, (token, run.stdout, run.stderr)
        assert code == 0 or (f"id {token} at (0, 2) is outside [0, 30)" in run.stderr and "Traceback" not in run.stderr)


@pytest.mark.skipif(_has_torch(), reason="PyTorch is installed: the error for its absence cannot occur")
def test_without_torch_an_exported_program_recipe_names_the_extra(tmp_path) -> None:
    (tmp_path / "net.pt2").write_bytes(b"not checked before torch is imported")
    recipe = {"name": "exported", "model": {"exported_program": "net.pt2"},
              "fleet": [{"name": "host", "profile": "host"}], "tuning": {"trials_per_task": 0}, "output": "out"}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    run = run_edgetune("build", "recipe.yaml", cwd=tmp_path)
    assert run.returncode == 2 and 'pip install "edgetune[torch]"' in run.stderr, run.stdout + run.stderr
    assert "Traceback" not in run.stderr


def test_an_unreadable_exported_program_is_an_input_error(tmp_path) -> None:
    if not _has_torch():
        pytest.skip("PyTorch is not installed: reading a .pt2 file stops at the missing extra")
    (tmp_path / "net.pt2").write_bytes(b"this is not a torch.export archive")
    recipe = {"name": "exported", "model": {"exported_program": "net.pt2"},
              "fleet": [{"name": "host", "profile": "host"}], "tuning": {"trials_per_task": 0}, "output": "out"}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    run = run_edgetune("build", "recipe.yaml", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "not a readable torch.export program" in run.stderr and "Traceback" not in run.stderr


def test_a_missing_exported_program_is_named_in_the_recipe(tmp_path) -> None:
    recipe = {"name": "exported", "model": {"exported_program": "absent.pt2"},
              "fleet": [{"name": "host", "profile": "host"}], "tuning": {"trials_per_task": 0}, "output": "out"}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    run = run_edgetune("build", "recipe.yaml", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "model.exported_program" in run.stderr and "absent.pt2" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_shape_and_constant_subgraphs_fold_away(corpus) -> None:
    """Flatten written as Shape -> Gather -> Unsqueeze -> Concat -> Reshape leaves no kernel of its own."""
    from edgetune.frontend.onnx import fuse_for_tuning, to_relax
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.tasks import extract_tasks

    target = resolve_profile("host", None).tvm_target()
    model = load_model(zoo=None, onnx_path=corpus["shape_subgraph"].path, input_shapes=None)
    names = [task.name for task in extract_tasks(fuse_for_tuning(to_relax(model), target), target)]
    assert not [n for n in names if any(op in n for op in ("shape_of", "concat", "take", "expand_dims"))], names


def test_variadic_ops_become_chains_of_two_input_ops_with_the_same_output() -> None:
    """Sum of one input, Mean of three, Max of four: TVM would stack them into a tensor of one more dimension."""
    from onnx import TensorProto, helper

    from edgetune.frontend.simplify import simplify_for_inference

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2])
    nodes = [helper.make_node("Sum", ["x"], ["a"]), helper.make_node("Mean", ["a", "x", "a"], ["b"]),
             helper.make_node("Max", ["b", "x", "a", "b"], ["c"]), helper.make_node("Min", ["c", "x"], ["y"])]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 2])
    graph = helper.make_graph(nodes, "variadic", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    rewritten, notes = simplify_for_inference(model)
    assert [n.op_type for n in rewritten.graph.node] == ["Identity", "Add", "Add", "Div", "Max", "Max", "Max", "Min"]
    assert notes == ["wrote 3 n-ary Sum/Max/Min/Mean nodes as chains of two-input ops"]
    feeds = {"x": np.random.default_rng(0).standard_normal([1, 4, 2, 2]).astype(np.float32)}
    np.testing.assert_allclose(_ort(rewritten, feeds)[0], _ort(model, feeds)[0], rtol=1e-6)


def test_weights_read_through_identity_nodes_still_fold_into_the_convolution() -> None:
    """PyTorch's exporter without constant folding reads each weight through an Identity (a chain of two here):
    their readers read the weights, so BatchNorm folds and Conv + ReLU stay one kernel, with the same output."""
    from onnx import TensorProto, helper, numpy_helper

    from edgetune.frontend.simplify import simplify_for_inference

    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal([8, 3, 3, 3]), "scale": rng.uniform(0.5, 2, 8),
               "shift": rng.standard_normal(8), "mean": rng.standard_normal(8), "var": rng.uniform(0.5, 2, 8)}
    initializers = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    nodes = [helper.make_node("Identity", ["w"], ["w.1"]), helper.make_node("Identity", ["w.1"], ["w.2"])]
    nodes += [helper.make_node("Identity", [k], [f"{k}.1"]) for k in ("scale", "shift", "mean", "var")]
    nodes += [helper.make_node("Conv", ["x", "w.2"], ["c"], pads=[1, 1, 1, 1]),
              helper.make_node("BatchNormalization", ["c", "scale.1", "shift.1", "mean.1", "var.1"], ["b"]),
              helper.make_node("Relu", ["b"], ["y"])]
    graph = helper.make_graph(nodes, "identities", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    rewritten, notes = simplify_for_inference(model)
    assert [n.op_type for n in rewritten.graph.node] == ["Conv", "Relu"]
    assert notes[0].startswith("bypassed 6 Identity nodes over weights")
    assert any("folded 1 BatchNormalization node" in n for n in notes)
    feeds = {"x": rng.standard_normal([1, 3, 8, 8]).astype(np.float32)}
    np.testing.assert_allclose(_ort(rewritten, feeds)[0], _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_many_identity_nodes_over_one_weight_copy_nothing_and_a_subgraph_keeps_its_name() -> None:
    """A thousand Identity nodes over one weight add no weight (nothing an input controls multiplies the bytes);
    an Identity whose output a subgraph reads stays, so the subgraph still finds it."""
    from onnx import TensorProto, helper, numpy_helper

    from edgetune.frontend.simplify import simplify_for_inference

    weight = numpy_helper.from_array(np.ones([4], np.float32), "w")
    nodes = [helper.make_node("Identity", ["w"], [f"w.{i}"]) for i in range(1000)]
    nodes.append(helper.make_node("Sum", [f"w.{i}" for i in range(1000)], ["summed"]))
    nodes.append(helper.make_node("Identity", ["w"], ["w.sub"]))
    branch = helper.make_graph([helper.make_node("Add", ["x", "w.sub"], ["branch_out"])], "branch", [],
                               [helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, [4])])
    nodes.append(helper.make_node("If", ["flag"], ["picked"], then_branch=branch, else_branch=branch))
    nodes.append(helper.make_node("Add", ["summed", "picked"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
              helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]
    graph = helper.make_graph(nodes, "aliases", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    rewritten, notes = simplify_for_inference(model)
    assert len(rewritten.graph.initializer) == 1
    assert notes[0].startswith("bypassed 1000 Identity nodes over weights")
    assert [n.output[0] for n in rewritten.graph.node if n.op_type == "Identity"] == ["w.sub"]
    feeds = {"x": np.arange(4, dtype=np.float32), "flag": np.array(True)}
    np.testing.assert_allclose(_ort(rewritten, feeds)[0], _ort(model, feeds)[0])


@pytest.mark.slow
def test_token_ids_outside_the_embedding_table_are_refused_by_run_py_and_the_deploy_program(
        corpus, untuned_release, tmp_path) -> None:
    """TVM's gather reads any index it is given: a token id past the table's 40 rows crashed the artifact or
    returned rows of whatever memory followed. io.json carries each index input's table length; run.py and the
    C++ deploy program refuse ids outside [-40, 40) (ONNX counts negative ids from the end), exit 2, naming the
    input and the range, and run every id inside it as ONNX Runtime does."""
    import subprocess
    import sys

    from edgetune.package.deploy import build_program, stage_runtime
    from edgetune.package.runtime import runtime_files
    from edgetune.profiles import load_profile
    from edgetune.toolchains import resolve_toolchain

    directory, _ = untuned_release
    artifact = Path(json.loads((directory / "out" / "token-transformer" / "summary.json").read_text())
                    ["targets"]["host"]["artifact_dir"])
    ids_entry = json.loads((artifact / "io.json").read_text())["inputs"][0]
    assert (ids_entry["index_from"], ids_entry["index_limit"]) == (-40, 40)
    proto = onnx.load(str(corpus["token_transformer"].path))
    toolchain = resolve_toolchain(load_profile("host"))
    runtime = stage_runtime(runtime_files(toolchain.arch), tmp_path / "runtime")
    program = build_program(artifact / "deploy", toolchain, runtime, tmp_path / "deploy")
    environment = {**os.environ, "LD_LIBRARY_PATH": str(runtime / "lib")}
    for position, token in enumerate((40, -41, 10**9, -40, 39)):
        ids = np.array([[1, 2, 3, 4, 5, 6]], dtype=np.int64)
        ids[0, position % 6] = token
        np.savez(tmp_path / "ids.npz", ids=ids)
        ids.tofile(tmp_path / "ids.bin")
        runs = (subprocess.run([sys.executable, str(artifact / "run.py"), "--input", str(tmp_path / "ids.npz"),
                                "--output", str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=120,
                               check=False),
                subprocess.run([str(program), str(artifact / "model.so"), str(tmp_path / "ids.bin"),
                                str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=environment,
                               check=False))
        if -40 <= token < 40:
            expected = _ort(proto, {"ids": ids})
            assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
            with np.load(tmp_path / "out.npz") as outputs:
                np.testing.assert_allclose(outputs["hidden"], expected[0], rtol=1e-4, atol=1e-4)
            hidden = np.fromfile(tmp_path / "out0.bin", dtype=np.float32).reshape(expected[0].shape)
            np.testing.assert_allclose(hidden, expected[0], rtol=1e-4, atol=1e-4)
            continue
        for run in runs:
            assert run.returncode == 2, (token, run.returncode, run.stdout, run.stderr)
            assert "Traceback" not in run.stderr
            assert f"{token}" in run.stderr and "[-40, 40)" in run.stderr, run.stderr
        assert "'ids'" in runs[0].stderr and "input 0" in runs[1].stderr
    assert "ids into a table of 40 rows" in (artifact / "README.md").read_text()
    # an edited io.json's table length or lowest id is refused as such, not run
    edited = Path(shutil.copytree(artifact, tmp_path / "edited"))
    spec = json.loads((edited / "io.json").read_text())
    hostile_edits = [("index_limit", value) for value in ("40; import os", -1, 0, True)] + [
        ("index_from", value) for value in ("0; import os", 1, -41, True, None)]
    for field, hostile in hostile_edits:
        entry = {**spec["inputs"][0], "index_limit": 40, "index_from": -40, field: hostile}
        (edited / "io.json").write_text(json.dumps({**spec, "inputs": [entry]}))
        refused = subprocess.run([sys.executable, "run.py"], cwd=edited, capture_output=True, text=True, timeout=120,
                                 check=False)
        assert refused.returncode == 1 and f"io.json: {field}" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
