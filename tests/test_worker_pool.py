"""Tuning's builder and runner workers: reused across batches, replaced when stuck, and free of PyTorch."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput
from tvm.s_tir.schedule import Schedule

from edgetune.tuning.builder import CandidateBuilder, cut_stragglers
from edgetune.tuning.intrinsics import register_tensor_intrinsics
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
    cores = os.cpu_count() or 1
    children_before = {child.pid for child in psutil.Process().children()}
    builder, runner = local_builder_runner(cores, "cpu")
    try:
        (built,) = builder.build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"}))])
        assert built.error_msg is None, built.error_msg
        (measured,) = runner.run([RunnerInput(built.artifact_path, "cpu", ArgInfo.from_prim_func(mod["main"]))])
        assert measured.result().error_msg is None and len(measured.result().run_secs) > 0
        timed_on = runner.pool.submit(os.getpid).result()
        # which worker a job lands on is a race between the pool's threads; how many processes the two started is not
        workers = {child.pid for child in psutil.Process().children()} - children_before
        assert runner.pool is builder.pool and timed_on in workers and len(workers) <= cores, (timed_on, workers)
    finally:
        builder.close()
        runner.close()  # a second close of the shared pool is harmless


def test_on_this_machine_a_candidate_is_linked_by_the_builder_and_only_loaded_by_the_runner() -> None:
    """The runner times one candidate at a time: a link there (TVM's `.tar` export) would keep the other cores
    waiting, so the builder's workers hand it a shared object, which the runner loads and times."""
    mod = _vector_add()
    builder, runner = local_builder_runner(os.cpu_count() or 1, "cpu")
    paths: list[str] = []
    try:
        built = builder.build([BuilderInput(mod, tvm.target.Target({"kind": "llvm"})) for _ in range(2)])
        assert [b.error_msg for b in built] == [None, None]
        paths = [b.artifact_path for b in built]
        assert all(path.endswith(".so") and os.path.isfile(path) for path in paths) and len(set(paths)) == 2
        with open(paths[0], "rb") as library:
            assert library.read(4) == b"\x7fELF"  # linked already, not an archive of object files
        measured = runner.run([RunnerInput(path, "cpu", ArgInfo.from_prim_func(mod["main"])) for path in paths])
        assert all(m.result().error_msg is None and len(m.result().run_secs) > 0 for m in measured)
    finally:
        builder.close()
        runner.close()
        for path in paths:  # the tuning loop removes a measured candidate's directory (remove_build_dir)
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_a_candidate_that_fails_to_link_leaves_no_directory_behind(tmp_path) -> None:
    """MetaSchedule removes a built candidate's directory after its run; one whose link failed has no artifact
    to remove, so the export removes its directory itself (after a test run, /tmp here held 31 empty ones)."""
    from edgetune.tuning.builder import export_shared_object

    module = tvm.compile(_vector_add(), target="llvm")
    with pytest.raises(Exception, match="no-such-compiler"):
        export_shared_object(str(tmp_path / "no-such-compiler"), str(tmp_path), module)
    assert list(tmp_path.iterdir()) == []
    linked = export_shared_object(None, str(tmp_path), module)  # a linked one keeps its directory, for the runner
    assert os.path.dirname(os.path.dirname(linked)) == str(tmp_path) and os.path.isfile(linked)


def test_candidates_link_without_the_compiler_driver_and_run(tmp_path, monkeypatch) -> None:
    """A candidate for this machine is linked by `ld` alone (g++'s driver took 35 of its 40 ms): with only `ld` on
    the PATH it still links, and a kernel calling libm's `expf` loads and computes what numpy does."""
    import subprocess

    import numpy as np

    from edgetune.tuning.builder import export_shared_object, link_for_this_machine

    a = te.placeholder((1000,), "float32", name="a")
    exp = te.compute((1000,), lambda i: te.exp(a[i]) + a[i] * a[i], name="b")
    module = tvm.compile(tvm.IRModule({"main": te.create_prim_func([a, exp])}), target="llvm")
    only_ld = tmp_path / "bin"
    only_ld.mkdir()
    (only_ld / "ld").symlink_to(shutil.which("ld"))
    monkeypatch.setenv("PATH", str(only_ld))
    linked = export_shared_object(None, str(tmp_path), module)
    monkeypatch.undo()
    assert "expf" in subprocess.run(["nm", "-u", linked], capture_output=True, text=True, check=True).stdout
    x = np.linspace(-3, 3, 1000, dtype="float32")
    y = tvm.runtime.tensor(np.zeros(1000, "float32"))
    tvm.runtime.load_module(linked)["main"](tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), np.exp(x) + x * x, rtol=1e-5)
    (tmp_path / "broken.o").write_bytes(b"not an object file")
    with pytest.raises(RuntimeError, match="Linking failed"):
        link_for_this_machine(str(tmp_path / "broken.so"), [str(tmp_path / "broken.o")])


def test_candidates_never_measured_end_with_their_builder(tmp_path, monkeypatch) -> None:
    """A batch built and never measured (a device lost, a stop request) is removed with the builder, and with it
    nothing but the directory the builder made (28 such candidates were left in /tmp after a day's runs)."""
    import tempfile

    from tvm.s_tir.meta_schedule.builder import BuilderInput

    from edgetune.tuning.builder import linking_builder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "users-file").write_text("kept")
    builder = linking_builder(1, None)
    built = builder.build([BuilderInput(_vector_add(), tvm.target.Target("llvm"))] * 2)
    assert all(b.error_msg is None and os.path.isfile(b.artifact_path) for b in built), built
    assert all(b.artifact_path.startswith(builder.owned_dir + os.sep) for b in built)
    builder.close()
    assert [p.name for p in tmp_path.iterdir()] == ["users-file"]


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


def test_a_job_running_far_longer_than_its_batch_is_cut_and_its_worker_replaced(tmp_path) -> None:
    pool = WorkerPool(2, timeout=None)
    try:
        started = time.monotonic()
        jobs = [pool.submit_job(60.0, time.sleep, 0.2) for _ in range(3)]
        pid_file = tmp_path / "pid"  # the straggler says which worker process runs it, then sleeps
        jobs.append(pool.submit_job(60.0, exec, f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
                                                "; time.sleep(30)"))
        assert cut_stragglers(jobs, factor=5, floor_s=1.0) == 1
        assert time.monotonic() - started < 10
        assert [job.cut_short for job in jobs] == [False, False, False, True]
        assert all(job.future.result() is None for job in jobs[:3])
        with pytest.raises(ChildProcessError):
            jobs[3].future.result()
        assert jobs[3].seconds() < 5
        straggler = int(pid_file.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(straggler, 0)  # its worker process is gone
        after = [pool.submit_job(60.0, time.sleep, 0.2) for _ in range(2)]  # one on each pool thread...
        after += [pool.submit_job(60.0, os.getpid) for _ in range(2)]
        assert cut_stragglers(after) == 0
        assert all(isinstance(job.future.result(), int) and job.future.result() != straggler for job in after[2:])
    finally:
        pool.shutdown()


def test_a_batch_of_quick_jobs_loses_none_to_the_straggler_rule() -> None:
    pool = WorkerPool(2, timeout=None)
    try:
        jobs = [pool.submit_job(60.0, time.sleep, seconds) for seconds in (0.05, 0.05, 0.1, 0.5)]
        # 10x the median, but half a second under the floor (0.8 s left a margin one stall of a busy machine takes)
        assert cut_stragglers(jobs, factor=5, floor_s=1.0) == 0
        assert all(job.future.result() is None and not job.cut_short for job in jobs)
    finally:
        pool.shutdown()


def _classifier() -> tvm.IRModule:
    """ResNet-18's last layer: a 1x512 by 512x1000 matmul and its bias."""
    x = te.placeholder((1, 512), name="x")
    w = te.placeholder((512, 1000), name="w")
    bias = te.placeholder((1000,), name="bias")
    k = te.reduce_axis((0, 512), name="k")
    product = te.compute((1, 1000), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="matmul")
    out = te.compute((1, 1000), lambda i, j: product[i, j] + bias[j], name="T_add")
    return tvm.IRModule({"main": te.create_prim_func([x, w, bias, out])})


def _classifier_candidates(decisions: list[tuple[list[list[int]], int]]) -> list[BuilderInput]:
    """Candidates of TVM's first design space for `_classifier` on an AVX-512 CPU: tiles and unroll given."""
    mod = _classifier()
    target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})
    register_tensor_intrinsics(target)  # what a build does: TuneContext would import every target's (25 s)
    context = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply",
                             search_strategy="evolutionary", num_threads=1)
    space = context.space_generator.generate_design_space(mod)[0].trace
    candidates = []
    for tiles, unroll in decisions:
        trace = space
        for instruction, decision in zip(space.decisions.keys(), [*tiles, unroll]):
            trace = trace.with_decision(instruction, decision, True)
        schedule = Schedule(mod)
        trace.apply_to_schedule(schedule, remove_postproc=False)
        assert all(postproc.apply(schedule) for postproc in context.space_generator.postprocs)
        candidates.append(BuilderInput(schedule.mod, target))
    return candidates


@pytest.mark.slow
def test_a_candidate_whose_build_takes_far_longer_than_its_batch_is_cut_short() -> None:
    """Vectors of 40 lanes under an unroll of 512 keep LLVM busy for 16-33 s here (a candidate TVM's search
    drew in a ResNet-18 build); its batch's other candidates build in a fraction of a second."""
    quick = [([[1, 1, 1, 1], [1, 20, 1, 50], [32, 16]], 0)] * 4
    straggler = ([[1, 1, 1, 1], [1, 25, 1, 40], [64, 8]], 3)
    batch = _classifier_candidates([*quick[:2], straggler, *quick[2:]])
    builder = CandidateBuilder(max_workers=2)
    try:
        # workers started and a first build done outside the time: on a busy machine both took seconds, and
        # the straggler's limit grows with the batch's builds (10 times their median, 5 s at least)
        builder.pool.start_workers()
        assert all(r.error_msg is None for r in builder.build(batch[:2]))
        started = time.monotonic()
        results = builder.build(batch)
        assert time.monotonic() - started < 15  # not waited for: its own build takes 16-33 s
        assert [r.error_msg is None for r in results] == [True, True, False, True, True]
        assert "a straggler, killed after" in results[2].error_msg
        (again,) = builder.build(batch[:1])  # the killed worker is replaced
        assert again.error_msg is None, again.error_msg
    finally:
        builder.close()


LEFT_BY_A_KILLED_BUILD = """
from edgetune.tuning.builder import linking_builder
print(linking_builder(1, None).owned_dir, flush=True)
import os, signal
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads Linux's /proc")
def test_a_killed_builds_candidates_are_removed_by_the_next_builder_and_nothing_else(tmp_path, monkeypatch) -> None:
    """A build killed outright leaves its builder's directory (one per killed-build test, each suite run); the next
    builder removes it, and keeps a live builder's, a directory named like ours without our mark, one marked in
    another pid namespace (a container sharing the folder: its pids name other processes), and a file."""
    import subprocess
    import sys
    import tempfile

    from edgetune.tuning.builder import CANDIDATES_OWNER, CANDIDATES_PREFIX, linking_builder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", LEFT_BY_A_KILLED_BUILD], capture_output=True, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120, check=False)
    assert killed.returncode == -9, killed.stderr
    orphan = killed.stdout.strip()
    killed_pid = Path(orphan, CANDIDATES_OWNER).read_text().split(" ")[0]
    assert os.path.dirname(orphan) == str(tmp_path) and os.path.isdir(orphan)
    unmarked = tmp_path / f"{CANDIDATES_PREFIX}users"
    unmarked.mkdir()
    elsewhere = tmp_path / f"{CANDIDATES_PREFIX}container"
    elsewhere.mkdir()
    (elsewhere / CANDIDATES_OWNER).write_text(f"{killed_pid} 1 pid:[1]")  # no such pid here: it runs there
    (tmp_path / "users-file").write_text("kept")
    live = linking_builder(1, None)
    try:
        assert not os.path.exists(orphan)
        following = linking_builder(1, None)  # the live builder's directory stays
        following.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [unmarked.name, elsewhere.name, "users-file", os.path.basename(live.owned_dir)])
    finally:
        live.close()


def _worker_processes() -> set[int]:
    """This process's children that are pool workers (`python -m edgetune.isolated`)."""
    workers = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile
            if "edgetune.isolated" in child.cmdline():
                workers.add(child.pid)
    return workers


def test_the_tunings_workers_start_when_its_builder_is_made_and_run_its_first_jobs() -> None:
    """A worker's start imports TVM (1.1-1.9 s on two busy cores): started with the builder, the workers are up
    when the first batch's builds come, instead of after its seeds were replayed or its drafts made."""
    before = _worker_processes()
    builder, runner = local_builder_runner(2, "cpu")
    try:
        deadline = time.monotonic() + 60
        while len(_worker_processes() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = _worker_processes() - before
        assert len(started) == 2
        assert {builder.pool.submit(os.getpid).result() for _ in range(8)} <= started
    finally:
        builder.close()
        runner.close()
