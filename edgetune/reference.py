"""The reference an artifact must match and the latency it must beat: ONNX Runtime for an ONNX model,
the torch.export program itself (in PyTorch) for an exported program."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnxruntime

from edgetune.frontend.model import LoadedModel


class ReferenceRuntime:
    def __init__(self, model: LoadedModel):
        self._program = model.program
        # the file when there is one (with its external data): a copy of its weights in memory costs 100 MB
        self._model: str | bytes = str(model.source) if model.source is not None else (
            model.proto.SerializeToString() if model.proto is not None else b"")
        self._inputs = [i.name for i in model.inputs]
        self._outputs = list(model.output_names)

    @property
    def name(self) -> str:
        """What the artifact's output is checked against, as the manifest names it."""
        return "pytorch" if self._program is not None else "onnxruntime"

    @property
    def display_name(self) -> str:
        """The reference as build messages name it."""
        return "PyTorch" if self._program is not None else "ONNX Runtime"

    def _runner(self, threads: int) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
        if self._program is not None:
            from edgetune.frontend.exported_program import program_runner

            run = program_runner(self._program, threads)
            return lambda inputs: run([inputs[n] for n in self._inputs])
        session = self._session(threads)
        return lambda inputs: session.run(self._outputs, inputs)

    def _session(self, threads: int) -> onnxruntime.InferenceSession:
        """ONNX Runtime on the model's own graph (ONNX models only)."""
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        return onnxruntime.InferenceSession(self._model, options, providers=["CPUExecutionProvider"])

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self._runner(threads=1)(inputs)))

    def time(self, inputs: dict[str, np.ndarray], threads: int, min_total_s: float = 1.0) -> float:
        """Median latency in milliseconds, with the same thread count the artifact gets."""
        run = self._runner(threads)
        run(inputs)
        samples = []
        deadline = time.perf_counter() + min_total_s
        while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 1000):
            start = time.perf_counter()
            run(inputs)
            samples.append(time.perf_counter() - start)
        return float(np.median(samples)) * 1e3
