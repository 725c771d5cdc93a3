"""Tuning's builder and runner workers: reused across batches, replaced when stuck, and free of PyTorch."""

from __future__ import annotations

import os
import time

import pytest
import tvm
from tvm import te
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput

from edgetune.tuning.builder import CandidateBuilder
from edgetune.tuning.local_runner import LocalCandidateRunner
from edgetune.tuning.tune import local_builder_runner
from edgetune.tuning.worker_pool import WorkerPool

_TORCH_LOADED = "__import__('sys').modules.get('torch') is not None"


def _vector_add() -> tvm.IRModule:
    a = te.placeholder((1024,), name="a")
    b = te.placeholder((1024,), name="b")
    out = te.compute((1024,), lambda i: a[i] + b[i], name="out")
    return tvm.IRModule({"main": te.create_prim_func([a, b, out])})


def test_builder_workers_last_across_batches_and_never_import_torch() -> None:
    pytest.importorskip("torch")  # without PyTorch installed there is nothing to keep out
    mod = _vector_add()
    target = tvm.target.Target({"kind": "llvm"})
    builder = CandidateBuilder(max_workers=1)
    try:
        pids = set()
        for _ in range(3):
            (built,) = builder.build([BuilderInput(mod, target)])
            assert built.error_msg is None, built.error_msg
            pids.add(builder.pool.submit(os.getpid).result())
        assert len(pids) == 1 and os.getpid() not in pids
        assert builder.pool.submit(eval, _TORCH_LOADED).result() is False

        runner = LocalCandidateRunner()
        (measured,) = runner.run([RunnerInput(built.artifact_path, "cpu", ArgInfo.from_prim_func(mod["main"]))])
        assert measured.result().error_msg is None and len(measured.result().run_secs) > 0
        assert runner.pool.submit(eval, _TORCH_LOADED).result() is False
        runner.close()
    finally:
        builder.close()


def test_on_this_machine_the_builder_and_the_runner_share_their_workers() -> None:
    """Every worker holds TVM's 190 MB: the runner times on a builder worker instead of a process of its own."""
    mod = _vector_add()
    builder, runner = local_builder_runner(os.cpu_count() or 1, "cpu")
    try:
        (built,) = builder.build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"}))])
        assert built.error_msg is None, built.error_msg
        builders = {builder.pool.submit(os.getpid).result() for _ in range(8)}
        (measured,) = runner.run([RunnerInput(built.artifact_path, "cpu", ArgInfo.from_prim_func(mod["main"]))])
        assert measured.result().error_msg is None and len(measured.result().run_secs) > 0
        assert runner.pool is builder.pool and runner.pool.submit(os.getpid).result() in builders
    finally:
        builder.close()
        runner.close()  # a second close of the shared pool is harmless


def test_a_job_past_its_timeout_is_killed_and_the_next_job_gets_a_fresh_worker() -> None:
    pool = WorkerPool(1, timeout=None)
    try:
        stuck = pool.submit(os.getpid).result()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            pool.submit_with_timeout(1.0, time.sleep, 30).result()
        assert time.monotonic() - started < 10
        assert pool.submit(os.getpid).result() != stuck
    finally:
        pool.shutdown()


def test_a_failing_candidate_is_an_error_message_not_an_exception(tmp_path) -> None:
    runner = LocalCandidateRunner()
    try:
        (measured,) = runner.run([RunnerInput(str(tmp_path / "missing.tar"), "cpu", [])])
        assert "LocalRunner: An exception occurred" in measured.result().error_msg
    finally:
        runner.close()
