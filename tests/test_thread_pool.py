"""edgetune's thread pool (edgetune/thread_pool.c): built here with the machine's C compiler and started on a
library TVM compiled and loaded, it runs the library's parallel loops, on the threads asked for, with the
results TVM's own pool gives; run.py starts it where io.json names it, and refuses a pool from elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgetune.isolated import processes_with
from edgetune.profiles import load_profile
from edgetune.thread_pool import POOL_LIBRARY_NAME, build_thread_pool, start_thread_pool
from edgetune.toolchains import resolve_toolchain


def _parallel_library(path: Path) -> Path:
    """A kernel whose outer loop is parallel (64 rows over the threads), exported as a shared library."""
    import tvm
    from tvm.script import tirx as T

    @T.prim_func
    def scale(a: T.Buffer((64, 4096), "float32"), b: T.Buffer((64, 4096), "float32")) -> None:
        T.func_attr({"global_symbol": "scale", "tir.noalias": True})
        for i in T.parallel(64):
            for j in range(4096):
                b[i, j] = a[i, j] * T.float32(2) + T.Cast("float32", i)

    tvm.compile(tvm.IRModule({"scale": scale}), target="llvm").export_library(str(path))
    return path


def _run_in_pool(library: Path, pool: Path, threads: int) -> tuple[bool, int, float]:
    """In a fresh process: whether the library's parallel launch moved to the pool, the threads it added, and
    the largest error of 300 runs against NumPy."""
    import ctypes

    import psutil
    import tvm

    module = tvm.runtime.load_module(str(library))
    launch = ctypes.c_void_p.in_dll(ctypes.CDLL(str(library)), "__TVMBackendParallelLaunch")
    tvm_launch, threads_before = launch.value, len(psutil.Process().threads())
    start_thread_pool(pool, library, threads)
    moved, added = launch.value not in (None, tvm_launch), len(psutil.Process().threads()) - threads_before
    a = np.random.default_rng(0).random((64, 4096), dtype=np.float32)
    expected = a * 2 + np.arange(64, dtype=np.float32)[:, None]
    error = 0.0
    for _ in range(300):
        b = tvm.runtime.tensor(np.zeros_like(a))
        module["scale"](tvm.runtime.tensor(a), b)
        error = max(error, float(np.abs(b.numpy() - expected).max()))
    return moved, added, error


def _start_refused(library: Path, pool: Path) -> list[str]:
    """In a fresh process: why the pool refuses a library TVM has not loaded, then a second thread count."""
    import tvm

    refused = []
    try:
        start_thread_pool(pool, library, 2)
    except RuntimeError as error:
        refused.append(str(error))
    tvm.runtime.load_module(str(library))
    start_thread_pool(pool, library, 2)
    try:
        start_thread_pool(pool, library, 3)
    except RuntimeError as error:
        refused.append(str(error))
    return refused


@pytest.fixture(scope="module")
def pool_and_library(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("thread-pool")
    cc = resolve_toolchain(load_profile("host")).cc
    return build_thread_pool(cc, directory / POOL_LIBRARY_NAME), _parallel_library(directory / "scale.so")


@pytest.mark.parametrize("threads", [2, 4])
def test_the_pool_runs_a_tvm_librarys_parallel_loops_on_its_threads(pool_and_library, threads) -> None:
    pool, library = pool_and_library
    with processes_with([{"TVM_THREAD_POOL_SPIN_COUNT": "0"}]) as (process,):
        moved, added, error = process.submit(_run_in_pool, library, pool, threads).result()
    assert moved and added == threads - 1  # the caller is the first of its threads
    assert error == 0.0


def test_the_pool_says_why_it_cannot_start(pool_and_library) -> None:
    pool, library = pool_and_library
    with processes_with([{}]) as (process,):
        refused = process.submit(_start_refused, library, pool).result()
    why = f"edgetune's thread pool did not start for {library.name}: "
    assert refused == [why + "the model library is not loaded in this process",
                       why + "the thread count is not 1-256, or differs from the pool's already started"]


def test_run_py_runs_the_model_with_the_pool_io_json_names(tiny_build, pool_and_library, tmp_path) -> None:
    directory, _ = tiny_build
    summary = json.loads((directory / "summary.json").read_text())
    artifact = shutil.copytree(summary["targets"]["host"]["artifact_dir"], tmp_path / "host")
    shutil.copyfile(pool_and_library[0], artifact / POOL_LIBRARY_NAME)
    spec = json.loads((artifact / "io.json").read_text())
    (artifact / "io.json").write_text(json.dumps({**spec, "cpu_thread_pool": POOL_LIBRARY_NAME}))
    checked = subprocess.run([sys.executable, "run.py", "--check"], cwd=artifact, capture_output=True, text=True,
                             timeout=120, check=False)
    assert checked.returncode == 0 and "OK" in checked.stdout, checked.stdout + checked.stderr
    (artifact / POOL_LIBRARY_NAME).write_bytes(b"not a shared object")  # run.py loads the pool io.json names
    broken = subprocess.run([sys.executable, "run.py"], cwd=artifact, capture_output=True, text=True, timeout=120,
                            check=False)
    assert broken.returncode == 1 and "io.json: cpu_thread_pool 'threads.so' is not edgetune's thread pool" in \
        broken.stderr and "Traceback" not in broken.stderr, broken.stderr
    wrong = subprocess.run([sys.executable, "run.py"], cwd=artifact, capture_output=True, text=True, timeout=120,
                           check=False, env={**os.environ, "TVM_NUM_THREADS": "many"})
    assert wrong.returncode == 1 and "TVM_NUM_THREADS='many' is not a thread count" in wrong.stderr, wrong.stderr
