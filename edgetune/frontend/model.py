"""What the import stage hands on: a model with concrete input shapes (ONNX graph or torch.export program),
whichever frontend loaded it. No TVM and no frontend imports here, so every frontend can share it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx


def quiet(message: str) -> None:
    """Where a model's notes go when nobody listens."""


@dataclass(frozen=True)
class ModelInput:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LoadedModel:
    """A model with concrete input shapes, and the hash that keys every cache built from it: an ONNX graph
    (`proto`), or a torch.export program (`program`, frontend/exported_program.py)."""

    name: str
    proto: onnx.ModelProto | None
    inputs: tuple[ModelInput, ...]
    output_names: tuple[str, ...]
    sha256: str
    index_limits: dict[str, int] = field(default_factory=dict)
    """Integer inputs used as indices (token ids into an embedding): input name -> rows of the table."""
    say: Callable[[str], None] = field(default=quiet, compare=False, repr=False)
    """Receives the import's notes (conversions, rewrites, layout kept) for the build log."""
    program: Any = field(default=None, compare=False, repr=False)
    """The torch.export program, when the model is one."""
    source: Path | None = field(default=None, compare=False)
    """The ONNX file it was read from (None: built here, a zoo model): ONNX Runtime reads it from there."""

    @property
    def counts_negative_ids(self) -> bool:
        """Whether the imported model counts a negative id from the table's end (ONNX's Gather) or would read before
        the table (a torch.export program's embedding: TVM's take reads any index; PyTorch refuses negative ones)."""
        return self.program is None

    def without_graph(self) -> LoadedModel:
        """The same model without its ONNX graph, once imported: a ResNet-50's weights are 100 MB that a
        build need not hold while it compiles (the reference reads the file itself)."""
        return replace(self, proto=None) if self.source is not None else self

    def sample_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Deterministic inputs, used both to verify against ONNX Runtime and to time the model.

        Integer inputs are drawn below the table size they index (a token id past the vocabulary is
        undefined behaviour, not a test), else from 0-9."""
        rng = np.random.default_rng(seed)
        samples = {}
        for i in self.inputs:
            if i.dtype.startswith("float"):
                samples[i.name] = rng.standard_normal(i.shape).astype(i.dtype)
            else:
                samples[i.name] = rng.integers(0, self.index_limits.get(i.name, 10), i.shape).astype(i.dtype)
        return samples


def tvm_message(exc: BaseException) -> str:
    """The meaningful line of a TVM error: the last one, without C++ check boilerplate."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    if last.startswith("Check failed:") and ": " in last.partition(" is false")[2]:
        last = last.partition(" is false")[2].lstrip(": ")
    return last
