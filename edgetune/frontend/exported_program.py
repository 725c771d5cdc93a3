"""PyTorch models without an ONNX step: a program written by `torch.export.save`, imported with TVM's
`from_exported_program`; the program itself is the reference the artifact must match.

Loading reads the saved graph and tensors; no Python code of the user's runs. PyTorch is an optional
extra (`pip install "edgetune[torch]"`): without it such a recipe is a clear error naming the extra.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetune.errors import InputError
from edgetune.frontend.model import LoadedModel, ModelInput, tvm_message

if TYPE_CHECKING:
    import tvm

TORCH_EXTRA = 'pip install "edgetune[torch]"'

_SUPPORTED_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8")


def import_torch() -> Any:
    """The torch module, or an InputError that names the extra to install."""
    try:
        import torch
    except ImportError as exc:
        raise InputError(f"model.exported_program: reading a torch.export program needs PyTorch, which is not "
                         f"installed; install it with {TORCH_EXTRA}") from exc
    return torch


def load_exported_program(path: Path, input_shapes: dict[str, list[int]] | None,
                          say: Callable[[str], None]) -> LoadedModel:
    """Read the program and its user inputs (static shapes: `input_shapes`, if given, must match them)."""
    torch = import_torch()
    try:
        _refuse_pickled_objects(path)
        with _weights_only_loads(), _quiet_torch_export_log():
            program = torch.export.load(str(path))
    except InputError:
        raise
    except Exception as exc:  # zip, schema and version errors alike mean "cannot use this file"
        raise InputError(f"model.exported_program: {path}: not a readable torch.export program "
                         f"(written by torch.export.save): {type(exc).__name__}: {exc}") from exc
    inputs = _program_inputs(program, input_shapes or {}, path)
    outputs = tuple(str(name) for name in program.graph_signature.user_outputs)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return LoadedModel(path.stem, None, inputs, outputs, digest, _embedding_sizes(program, inputs), say,
                       program=program)


_SAME_VALUES = frozenset({"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "permute",
                          "expand", "clone", "contiguous", "alias", "slice", "select", "to", "_to_copy", "type_as"})
"""ATen ops whose output holds (some of) their first argument's values, rearranged or cast: token ids reach an
embedding through them (`ids.view(-1, n)`, `ids.to(torch.int32)`); a cast to a float type is not followed."""


def _embedding_sizes(program: Any, inputs: tuple[ModelInput, ...]) -> dict[str, int]:
    """For each integer input whose values reach an embedding's indices unchanged (directly or through
    `_SAME_VALUES` ops), the number of rows of its table. The graph lists nodes in dependency order."""
    source_input = {i.name: i.name for i in inputs if i.dtype.startswith(("int", "uint"))}
    sizes: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        first = getattr(node.args[0], "name", None)
        op = str(node.target).split(".")[1] if str(node.target).startswith("aten.") else ""
        if op in _SAME_VALUES and first in source_input and _holds_integers(node):
            source_input[node.name] = source_input[first]
        elif op == "embedding" and len(node.args) >= 2 and getattr(node.args[1], "name", None) in source_input:
            rows = getattr(node.args[0], "meta", {}).get("val")
            if rows is not None and isinstance(rows.shape[0], int) and rows.shape[0] >= 1:
                name = source_input[node.args[1].name]
                sizes[name] = min(sizes.get(name, rows.shape[0]), rows.shape[0])
    return sizes


def _holds_integers(node: Any) -> bool:
    """Whether the node's result is an integer tensor (as the export traced it): a cast to float is no id."""
    value = node.meta.get("val")
    dtype = getattr(value, "dtype", None)
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"


def _refuse_pickled_objects(path: Path) -> None:
    """A program whose constants are pickled Python objects (custom or opaque script objects) would run code
    from the file as torch.export.load unpickles them: such a file is refused before loading."""
    from torch.export.pt2_archive.constants import CUSTOM_OBJ_FILENAME_PREFIX, OPAQUE_OBJ_FILENAME_PREFIX

    with zipfile.ZipFile(path) as archive:
        pickled = [name for name in archive.namelist() if "/constants/" in name and
                   name.rsplit("/", 1)[-1].startswith((CUSTOM_OBJ_FILENAME_PREFIX, OPAQUE_OBJ_FILENAME_PREFIX))]
    if pickled:
        raise InputError(f"model.exported_program: {path}: holds pickled Python objects ({pickled[0]}), which "
                         "loading would execute; edgetune loads only programs made of tensors and operators")


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every torch.load inside torch.export.load restricted to tensors (no arbitrary unpickling), whatever
    the archive asks for (torch's own switch, read on each call)."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


@contextlib.contextmanager
def _quiet_torch_export_log() -> Iterator[None]:
    """torch.export.load logs a traceback before giving up on a bad file; the InputError says it instead."""
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _program_inputs(program: Any, input_shapes: dict[str, list[int]], path: Path) -> tuple[ModelInput, ...]:
    user_inputs = list(program.graph_signature.user_inputs)
    values = {node.name: node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"}
    problems = [f"model.input_shapes.{name}: {path.name} has no input {name!r}; its inputs are {user_inputs}"
                for name in input_shapes if name not in user_inputs]
    result = []
    for name in user_inputs:
        value = values.get(name)
        dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
        if dtype not in _SUPPORTED_DTYPES:
            problems.append(f"model.exported_program: input {name!r} is not a tensor of {', '.join(_SUPPORTED_DTYPES)}")
            continue
        dims = [d if isinstance(d, int) else None for d in value.shape]
        if None in dims:
            problems.append(f"model.exported_program: input {name!r} has dynamic dimensions {list(value.shape)}; "
                            "export the program with static example inputs (no dynamic_shapes)")
            continue
        wanted = input_shapes.get(name)
        if wanted is not None and list(wanted) != dims:
            problems.append(f"model.input_shapes.{name}: the program was exported for shape {dims}, got "
                            f"{list(wanted)}; export it again with an example input of that shape")
        result.append(ModelInput(name, tuple(dims), dtype))
    if problems:
        raise InputError(problems)
    return tuple(result)


def program_to_relax(model: LoadedModel) -> tvm.IRModule:
    """Import with the weights bound as constants (`to_relax` then decomposes inference-only ops)."""
    from tvm.relax.frontend.torch import from_exported_program

    try:
        return from_exported_program(model.program, keep_params_as_input=False)
    except Exception as exc:  # the importer raises many kinds of errors for unsupported ops
        raise InputError(f"model '{model.name}': TVM's torch.export importer failed: {tvm_message(exc)}") from exc


def program_runner(program: Any, threads: int | None = None) -> Callable[[list[Any]], list[Any]]:
    """A function from numpy inputs to the program's outputs (numpy arrays), run by PyTorch in inference mode."""
    torch = import_torch()
    if threads:
        torch.set_num_threads(threads)
    module = program.module()

    def run(inputs: list[Any]) -> list[Any]:
        with torch.inference_mode():
            outputs = module(*[torch.from_numpy(x) for x in inputs])
        flat = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        return [o.detach().numpy() for o in flat]

    return run
