"""TVM's kernels run on the target's cores, not on TVM's own guess (half the CPUs it sees, on x86)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import subprocess, sys
import tvm
from edgetune.runtime import use_cpu_threads
use_cpu_threads({cores})
worker = subprocess.run([sys.executable, "-c", "import tvm; print(tvm.get_global_func('runtime.NumThreads')())"],
                        capture_output=True, text=True, check=True)
print(tvm.get_global_func("runtime.NumThreads")(), worker.stdout.strip())
"""


def pool_sizes(cores: int) -> list[str]:
    """This process's pool size and a worker's it starts, after `use_cpu_threads(cores)`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(cores=cores)], capture_output=True, text=True,
                         env=clean, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


@pytest.mark.parametrize("cores", sorted({1, len(os.sched_getaffinity(0))}))
def test_kernels_run_on_the_given_cores_here_and_in_workers_started_later(cores: int) -> None:
    assert pool_sizes(cores) == [str(cores), str(cores)]


def test_a_pool_started_wider_is_narrowed() -> None:
    script = ("import tvm\nfrom edgetune.runtime import use_cpu_threads\n"
              "pool_size = tvm.get_global_func('runtime.NumThreads')\nprint(pool_size())\n"
              "use_cpu_threads(1)\nprint(pool_size())")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TVM_NUM_THREADS": "2"}, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2", "1"]


KEPT_APART = """
import glob, json, os, threading
import tvm
from edgetune.runtime import off_the_pool_threads_cores, use_cpu_threads
use_cpu_threads(2)
before = os.sched_getaffinity(0)
with off_the_pool_threads_cores():
    inside = os.sched_getaffinity(0)
    pool_cores = set()
    for task in glob.glob("/proc/self/task/*"):
        if task.endswith("/" + str(threading.get_native_id())):
            continue
        line = [l for l in open(task + "/status") if l.startswith("Cpus_allowed_list")][0]
        if line.split(":")[1].strip().isdigit():
            pool_cores.add(int(line.split(":")[1]))
print(json.dumps([sorted(before), sorted(inside), sorted(pool_cores), sorted(os.sched_getaffinity(0))]))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: TVM's pool has no thread of its own")
def test_a_timing_thread_keeps_off_the_cores_of_the_pools_threads_and_gets_its_cores_back() -> None:
    """The thread that runs a kernel's first share is kept off the core TVM bound its pool thread to (sharing it
    ran a fresh worker's first timings at twice their time), and is free again afterwards."""
    run = subprocess.run([sys.executable, "-c", KEPT_APART], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    before, inside, pool_cores, after = json.loads(run.stdout.splitlines()[-1])
    assert pool_cores and inside and not set(inside) & set(pool_cores)
    assert set(inside) | set(pool_cores) <= set(before) and after == before
