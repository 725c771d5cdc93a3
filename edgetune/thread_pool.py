"""edgetune's thread pool for an artifact's CPU kernels (thread_pool.c): built with the target's C compiler
beside the model library, and started in a process after TVM loaded that library.

Why: TVM's pool either yields its core while a thread waits (beside another busy process each yield hands that
process the core) or, with a spin count of 0, pays a thread's wake-up per parallel loop: a MobileNet-V2 ran
1.3x slower sleeping than spinning on an idle 2-core VM, and 2.7x slower spinning than sleeping beside a
nice-19 busy loop. This pool's threads spin on the CPU's pause hint for 50 us, then sleep, and a free thread
takes any share not started yet (runtime.thread_wait_policy weighs it against TVM's two ways).
"""

from __future__ import annotations

import ctypes
import subprocess
from importlib import resources
from pathlib import Path

from edgetune.errors import BuildError

POOL_LIBRARY_NAME = "threads.so"
"""The pool's file in an artifact, beside the model library."""

_START_ERRORS = {
    -1: "the model library is not loaded in this process",
    -3: "the model library synchronises its shares (TVM's parallel barrier), which the pool does not give",
    -4: "the thread count is not 1-256, or differs from the pool's already started",
    -5: "a pool thread could not start",
}


def pool_source() -> Path:
    """thread_pool.c as shipped inside the package."""
    return Path(str(resources.files("edgetune") / "thread_pool.c"))


def build_thread_pool(cc: Path, output: Path) -> Path:
    """The pool compiled and linked by `cc` (the target's C compiler) as a shared object at `output`."""
    argv = [str(cc), "-O2", "-std=gnu11", "-shared", "-fPIC", "-pthread", str(pool_source()), "-o", str(output)]
    result = subprocess.run(argv, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"building edgetune's thread pool with {cc.name} failed (exit {result.returncode}):\n"
                         + "\n".join(result.stderr.splitlines()[-8:]))
    return output


def start_thread_pool(pool: Path, model_library: Path, threads: int) -> None:
    """Point `model_library`'s parallel loops, loaded in this process by TVM, at the pool (`threads` threads,
    the caller's included); raises RuntimeError saying why not."""
    code = ctypes.CDLL(str(pool)).edgetune_thread_pool_start(str(model_library).encode(), threads)
    if code != 0:
        raise RuntimeError(f"edgetune's thread pool did not start for {model_library.name}: "
                           f"{_START_ERRORS.get(code, f'error {code}')}")
