"""TVM's kernels run on the target's cores, not on TVM's own guess (half the CPUs it sees, on x86)."""

from __future__ import annotations

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
