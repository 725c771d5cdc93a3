"""ONNX Runtime as the reference: the output an artifact must match and the latency it must beat."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime

from edgetune.frontend.onnx import LoadedModel


class ReferenceRuntime:
    def __init__(self, model: LoadedModel):
        self._bytes = model.proto.SerializeToString()
        self._outputs = list(model.output_names)

    def _session(self, threads: int) -> onnxruntime.InferenceSession:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        return onnxruntime.InferenceSession(self._bytes, options, providers=["CPUExecutionProvider"])

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self._session(threads=1).run(self._outputs, inputs)))

    def time(self, inputs: dict[str, np.ndarray], threads: int, min_total_s: float = 1.0) -> float:
        """Median latency in milliseconds, with the same thread count the artifact gets."""
        session = self._session(threads)
        session.run(self._outputs, inputs)
        samples = []
        deadline = time.perf_counter() + min_total_s
        while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 1000):
            start = time.perf_counter()
            session.run(self._outputs, inputs)
            samples.append(time.perf_counter() - start)
        return float(np.median(samples)) * 1e3
