"""A busy program beside the build takes cores from the timing; the build's own processes and nicer ones do not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import tvm
from tvm import te
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput

from edgetune.machine_load import OtherLoad, sampled_free_threads, waited_for_a_core_s
from edgetune.tuning.builder import CandidateBuilder
from edgetune.tuning.local_runner import LocalCandidateRunner
from edgetune.tuning.measurements import mean_seconds
from edgetune.tuning.tune import timing

BUSY_LOOP = f"{sys.executable} -c 'while True: pass'"

pytestmark = [pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                                 reason="reads Linux's /proc; needs two cores"),
              pytest.mark.serial]  # another test's programs would count as other programs here


@contextmanager
def other_program(prefix: str = "") -> Iterator[None]:
    """A busy loop started as another user's program is: not a descendant of this process (the shell that
    starts it exits, and it is left to init)."""
    started = subprocess.run(["sh", "-c", f"{prefix} {BUSY_LOOP} >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True)
    pid = int(started.stdout)
    time.sleep(0.2)  # running, and its start's own CPU time behind us
    try:
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)  # reaped by init, whose children's time then grows once: not in a later test's readings


def test_an_idle_machine_leaves_every_core_to_the_timing() -> None:
    assert sampled_free_threads(2, seconds=0.5) == 2


def test_a_busy_program_beside_the_build_takes_a_core() -> None:
    with other_program():
        load = OtherLoad()
        time.sleep(0.5)
        assert 0.7 < load.cores_taken() < 1.5
        time.sleep(0.5)
        cores = os.cpu_count() or 1
        assert load.free_threads(cores) == cores - 1


def test_the_builds_own_workers_and_lower_priority_programs_take_nothing() -> None:
    worker = subprocess.Popen(["sh", "-c", f"exec {BUSY_LOOP}"])  # a child, as the tuning's workers are
    try:
        with other_program("nice -n 10"):
            assert sampled_free_threads(2, seconds=0.5) == 2
    finally:
        worker.kill()
        worker.wait()


def _spin_on_core_zero(seconds: float) -> float:
    """Run `seconds` of wall time on core 0 alone; the calling thread's wait for a core meanwhile."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        waited_before, ends = waited_for_a_core_s(), time.monotonic() + seconds
        while time.monotonic() < ends:
            pass
        return waited_for_a_core_s() - waited_before
    finally:
        os.sched_setaffinity(0, allowed)


def test_a_thread_that_shares_its_core_counts_its_wait_for_it() -> None:
    """What a compile beside another compile is counted without (selection.rank_cost): the time it was ready and
    had no core. Alone on its core a thread hardly waits; beside a busy loop on that core, about half the time."""
    assert _spin_on_core_zero(0.4) < 0.1
    loop = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
    try:
        time.sleep(0.2)
        assert 0.1 < _spin_on_core_zero(0.6) < 0.5
    finally:
        loop.kill()
        loop.wait()


def _pool_threads(runner: LocalCandidateRunner) -> int:
    """The size of the worker's TVM thread pool, read in the worker (a builtin travels to it by name)."""
    return runner.pool.submit_with_timeout(None, eval, "__import__('tvm').get_global_func('runtime.NumThreads')()"
                                           ).result()


def _candidate() -> tuple[str, list]:
    a = te.placeholder((1 << 16,), name="a")
    out = te.compute((1 << 16,), lambda i: a[i] * 2.0, name="out")
    mod = tvm.IRModule({"main": te.create_prim_func([a, out])})
    (built,) = CandidateBuilder(max_workers=1).build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"}))])
    assert built.error_msg is None, built.error_msg
    return built.artifact_path, ArgInfo.from_prim_func(mod["main"])


def test_a_candidate_is_timed_on_the_cores_a_busy_program_left_and_counted() -> None:
    artifact, args = _candidate()
    runner = LocalCandidateRunner(timing("cpu"), cpu_threads=2)
    try:
        with other_program():
            time.sleep(0.5)
            beside_started = time.monotonic()
            (future,) = runner.run([RunnerInput(artifact, "cpu", args)])
            assert mean_seconds(future.result().run_secs) < 1.0
            assert runner.noise.counts.on_fewer_threads == 1
            assert _pool_threads(runner) == 1
            beside_s = time.monotonic() - beside_started
        # the next batch reads the load since this one's reading, which the program shared for `beside_s` (a
        # batch takes longer on a slow or loaded machine): wait until that is under a fifth of the window
        time.sleep(max(2.0, 4 * beside_s))
        (future,) = runner.run([RunnerInput(artifact, "cpu", args)])  # the program ended: both threads again
        assert future.result().error_msg is None
        assert runner.noise.counts.on_fewer_threads == 1
        assert _pool_threads(runner) == 2
    finally:
        runner.close()


def test_a_single_threaded_candidate_timed_beside_a_busy_program_is_not_taken_for_twice_as_fast() -> None:
    """A kernel without a parallel loop runs as long on one thread as on two: its timing on the thread a busy
    program left is its time on the target. Scaled by half, as if it split evenly, it read 0.64x its idle time;
    unscaled, 1.28x (the busy program slows the core beside it a little)."""
    a = te.placeholder((1 << 21,), name="a")
    out = te.compute((1 << 21,), lambda i: a[i] * 2.0 + 1.0, name="out")  # 8 MB in and out: about a millisecond
    mod = tvm.IRModule({"main": te.create_prim_func([a, out])})
    (built,) = CandidateBuilder(max_workers=1).build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"}))])
    assert built.error_msg is None, built.error_msg
    candidate = RunnerInput(built.artifact_path, "cpu", ArgInfo.from_prim_func(mod["main"]))
    runner = LocalCandidateRunner(timing("cpu"), cpu_threads=2)
    try:
        idle_s = min(mean_seconds(runner.run([candidate])[0].result().run_secs) for _ in range(3))
        with other_program():
            time.sleep(0.5)
            busy_s = min(mean_seconds(runner.run([candidate])[0].result().run_secs) for _ in range(3))
            assert runner.noise.counts.on_fewer_threads == 3
    finally:
        runner.close()
    assert 0.8 < busy_s / idle_s < 1.75


def test_the_cost_model_fits_on_the_cores_a_busy_program_leaves() -> None:
    """Beside a busy program an XGBoost fit on both threads took twice its time on one: each boosting round
    waits for the thread that shares its core with the program. The fit reads the load since the last one;
    the booster's own configuration says on how many threads it was fit."""
    import numpy as np
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from edgetune.tuning.cost_model.ranking import RankingCostModel

    rng = np.random.default_rng(0)
    cores = os.cpu_count() or 1
    model = RankingCostModel(num_threads=cores, rounds=5)

    def fit_threads_after_a_batch() -> int:
        rows = rng.random((8, 9)).astype(np.float32)
        model.add("task", rows, [RunnerResult([float(1e-4 * (1 + r[0]))], None) for r in rows])
        assert model.fit_if_stale("task")  # the model refits before it ranks the task again
        return int(json.loads(model.booster.save_config())["learner"]["generic_param"]["nthread"])

    time.sleep(0.5)
    fit_started = time.monotonic()
    assert fit_threads_after_a_batch() == cores
    fit_s = time.monotonic() - fit_started
    with other_program():
        # the next reading's window holds this fit too (1.05 s here, 0.70 s of it beside the loop: 0.67 of a core
        # taken); a fit slow on a busy runner must not bring the loop's share under TAKEN_CORE
        time.sleep(0.5 + 2 * fit_s)
        assert fit_threads_after_a_batch() == cores - 1
    time.sleep(0.5)
    assert fit_threads_after_a_batch() == cores


def test_a_transferred_models_fits_of_one_batch_take_one_reading() -> None:
    """The transfer's fits of a batch read the load once, over the time since the last batch: a reading over a fit
    alone would be too short to see a busy core. Here the busy program ends before the batch: the batch's reading
    saw it, a reading over the prior's fit alone would not."""
    import numpy as np
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from edgetune.tuning.cost_model.ranking import RankingCostModel
    from edgetune.tuning.cost_model.transfer import TransferCostModel
    from edgetune.tuning.transfer.siblings import SiblingRecords, TransferStats

    def threads_of(booster) -> int:
        return int(json.loads(booster.save_config())["learner"]["generic_param"]["nthread"])

    rng = np.random.default_rng(0)
    cores = os.cpu_count() or 1
    sibling_rows = rng.random((16, 9)).astype(np.float32)
    siblings = SiblingRecords(["sib"], {"sib/task": (list(sibling_rows), list(1e-4 * (1 + sibling_rows[:, 0])))})
    model = TransferCostModel(RankingCostModel(num_threads=cores, rounds=5), siblings, "momentum",
                              TransferStats(["sib"], "momentum", 16))
    with other_program():
        time.sleep(1.0)
    rows = rng.random((8, 9)).astype(np.float32)
    model.learn("task", "conv", rows, [RunnerResult([float(1e-4 * (1 + r[0]))], None) for r in rows])
    assert threads_of(model.online) == cores - 1


WHOLE_MODEL_TIMING = """
import json
import tvm
from edgetune.machine_load import on_free_cores
pool_size = tvm.get_global_func("runtime.NumThreads")
with on_free_cores({cores}) as threads:
    inside = pool_size()
print(json.dumps([threads, inside, pool_size()]))
"""


def _whole_model_timing_threads(cores: int) -> list[int]:
    """The threads a model timed whole in a build's process runs on (as the budget's reserve and the in-model
    comparison time it), told and counted in the pool, and the pool's size afterwards."""
    run = subprocess.run([sys.executable, "-c", WHOLE_MODEL_TIMING.format(cores=cores)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_a_model_timed_whole_in_the_build_runs_on_the_cores_a_busy_program_left_then_on_all() -> None:
    """A budget's reserve timed its model on both threads beside a busy loop, where the comparison it sized runs on
    one: it kept 237 s for stages that took 77 s."""
    cores = os.cpu_count() or 1
    assert _whole_model_timing_threads(cores) == [cores, cores, cores]
    with other_program():
        assert _whole_model_timing_threads(cores) == [cores - 1, cores - 1, cores]
