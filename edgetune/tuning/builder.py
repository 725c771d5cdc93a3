"""Candidate builder: MetaSchedule's local build, on long-lived workers, without the 10-second import.

TVM's LocalBuilder starts new workers for every batch; these workers (tuning/worker_pool.py) last the
whole tuning run. TVM's default build function imports `tvm.s_tir.tensor_intrin` (mostly CUDA
intrinsics) in every fresh worker; for the targets edgetune tunes on the CPU that import buys nothing,
so this build function does the same lowering without it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func

from edgetune.tuning.worker_pool import WorkerPool


def build_candidate(mod, target, _params):
    """MetaSchedule's default build, minus the tensor-intrinsic import (runs in a builder worker)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


@derived_object
class CandidateBuilder(PyBuilder):
    """Builds a batch of candidates in parallel, each into an artifact the runner loads.

    `f_export` None keeps TVM's `.tar` export (linked where it runs); a device gets linked `.so` files.
    `pool`: workers shared with the runner (default: `max_workers` of its own). `close()` ends the workers
    (they also end with the builder).
    """

    def __init__(self, max_workers: int, timeout_sec: float = 60.0, f_export: Callable | None = None,
                 pool: WorkerPool | None = None) -> None:
        super().__init__()
        self.timeout_sec = timeout_sec
        self.f_export = f_export
        self.pool = pool or WorkerPool(max_workers, timeout_sec)

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        jobs = [self.pool.submit_with_timeout(self.timeout_sec, _worker_func, build_candidate, self.f_export, i.mod,
                                              i.target, _serialize_params(i.params)) for i in build_inputs]
        return [self._result(job) for job in jobs]

    def _result(self, job: Future) -> BuilderResult:
        try:
            return BuilderResult(job.result(), None)
        except TimeoutError:
            return BuilderResult(None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds")
        except Exception as exc:  # the candidate's own failure, reported as TVM's builder reports it
            return BuilderResult(None, f"LocalBuilder: An exception occurred\n{exc}")

    def close(self) -> None:
        self.pool.shutdown()
