"""A CPU candidate is timed as the model runs it: its weights come from memory, not from a warm cache."""

from __future__ import annotations

import pytest
import tvm
from tvm import te
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, RunnerInput

from edgetune.tuning.analyzer.tir import thread_share
from edgetune.tuning.builder import CandidateBuilder, parallel_extent_beside
from edgetune.tuning.local_runner import LocalCandidateRunner
from edgetune.tuning.measurements import mean_seconds
from edgetune.tuning.tune import timing

_WEIGHT_FLOATS = 32 << 10  # 128 KB: warm, all three buffers sit in a core's L2; cold, they come from memory


def _mean_us(config: EvaluatorConfig, artifact: str, args: list) -> float:
    (future,) = LocalCandidateRunner(config).run([RunnerInput(artifact, "cpu", args)])
    result = future.result()
    assert result.error_msg is None, result.error_msg
    return mean_seconds(result.run_secs) * 1e6


@pytest.mark.serial
def test_a_cpu_kernel_is_timed_with_its_weights_out_of_the_cache() -> None:
    """Cold runs about 3x warm here; each is the fastest of three turns, since one timing in a slow spell of the
    VM once gave a warm 7.8 us against a cold 11.3 (1.44x)."""
    activation = te.placeholder((_WEIGHT_FLOATS,), name="activation")
    weight = te.placeholder((_WEIGHT_FLOATS,), name="weight")
    out = te.compute((_WEIGHT_FLOATS,), lambda i: activation[i] + weight[i], name="out")
    mod = tvm.IRModule({"main": te.create_prim_func([activation, weight, out])})
    (built,) = CandidateBuilder(max_workers=1).build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"}))])
    assert built.error_msg is None, built.error_msg
    args = ArgInfo.from_prim_func(mod["main"])

    turns = [(_mean_us(EvaluatorConfig(), built.artifact_path, args), _mean_us(timing("cpu"), built.artifact_path, args))
             for _ in range(3)]
    warm_us, cold_us = min(warm for warm, _ in turns), min(cold for _, cold in turns)
    assert cold_us > 1.5 * warm_us, turns


def test_gpu_kernels_keep_metaschedules_timing() -> None:
    assert timing("cuda").enable_cpu_cache_flush is False
    assert timing("cuda").number == EvaluatorConfig().number


def test_the_model_and_the_reference_take_turns_round_by_round() -> None:
    from edgetune.runtime import each_in_turns

    calls: list[str] = []
    ours_ms = iter([10.0, 13.5, 10.2])  # the second round of ours ran beside a burst of other work
    reference_ms = iter([12.0, 12.1, 11.9])

    def time_ours() -> float:
        calls.append("ours")
        return next(ours_ms)

    def time_reference() -> float:
        calls.append("reference")
        return next(reference_ms)

    rounds = each_in_turns({"ours": time_ours, "reference": time_reference}, rounds=3)
    assert calls == ["ours", "reference", "reference", "ours", "ours", "reference"]
    assert rounds == {"ours": [10.0, 13.5, 10.2], "reference": [12.0, 12.1, 11.9]}


def _matmul_vm(n: int):
    """A real relax model: one n x n matmul, compiled for this CPU (no tuning: its default loop nest)."""
    import numpy as np
    from tvm import relax

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, n), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.matmul(x, x))
        builder.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(builder.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target("llvm")), tvm.cpu(0))
    return vm, [np.random.default_rng(0).random((n, n), dtype=np.float32)]


@pytest.mark.serial
def test_a_time_budget_keeps_what_a_model_timing_takes() -> None:
    """A budget keeps `time_model_seconds` for each timing of the last stages (build/tune.py): it must follow what
    `time_model` does, for a fast model (repeats sized by three calls) and one whose single call takes the whole
    timing's length (a warm-up and single calls: here with a 0.05-s timing, as an untuned model with 1 s), and one
    whose first call takes ten timings' length (that call alone: here with a 0.002-s timing)."""
    import time

    from edgetune.runtime import time_model, time_model_seconds

    for n, min_total_s in ((64, 0.2), (512, 0.05), (512, 0.002)):
        vm, inputs = _matmul_vm(n)
        call_ms = time_model(vm, inputs, tvm.cpu(0), min_total_s=min_total_s)
        started = time.perf_counter()
        time_model(vm, inputs, tvm.cpu(0), min_total_s=min_total_s)
        took_s = time.perf_counter() - started
        expected_s = time_model_seconds(call_ms / 1e3, min_total_s)
        assert 0.6 * expected_s < took_s < 1.6 * expected_s + 0.02, (n, call_ms, took_s, expected_s)


def test_a_built_candidate_carries_its_parallel_extent_to_the_runner() -> None:
    a = te.placeholder((7, 64), name="a")
    out = te.compute((7, 64), lambda i, j: a[i, j] + 1.0, name="out")
    schedule = tvm.s_tir.Schedule(te.create_prim_func([a, out]))
    parallel = schedule.copy()
    parallel.parallel(parallel.get_loops(parallel.get_sblock("out"))[0])
    built = CandidateBuilder(max_workers=1).build([BuilderInput(s.mod, tvm.target.Target({"kind": "llvm"}))
                                                   for s in (schedule, parallel)])
    assert [parallel_extent_beside(b.artifact_path) for b in built] == [1, 7]
    assert parallel_extent_beside("/nonexistent/candidate.so") is None


@pytest.mark.parametrize(("extent", "threads", "cpu_threads", "share"), [
    (1, 1, 2, 1.0),  # single-threaded: as long on both
    (2, 1, 2, 0.5), (64, 1, 2, 0.5),  # an even split halves it
    (7, 1, 2, 4 / 7),  # the target's threads run 4 and 3 of 7
    (3, 2, 4, 0.5),  # 2 of 3 on two threads, 1 on four
    (None, 1, 2, 0.5),  # unknown: scaled as if it split evenly
])
def test_a_timing_on_fewer_threads_is_scaled_by_the_target_threads_share_of_the_parallel_loop(
        extent: int | None, threads: int, cpu_threads: int, share: float) -> None:
    assert thread_share(extent, threads, cpu_threads) == pytest.approx(share)
