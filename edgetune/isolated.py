"""Processes of edgetune's own that never import PyTorch: large libraries, and TVM's pool workers.

TVM never unloads a library it loaded: its weights stay in the process for good. A ResNet-50 build loaded
three (tuned, untuned, the packaged one), 240 MB each, and peaked at 1.9 GB for 100 MB of weights. This
module imports no TVM, so the process it starts imports only what the function it runs needs.

`python -m edgetune.isolated READ_FD WRITE_FD` is TVM's pool worker (`tvm.exec.popen_worker`) without
PyTorch, which `tvm_ffi` imports whenever it is installed: 200 MB and 2 s more for each builder and runner
worker, none of which uses it (tuning/worker_pool.py starts them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

LOADED_APART_BYTES = 64 * 1024 * 1024
"""Libraries larger than this are loaded in a process of their own; a process costs about 2 s (importing
TVM), not worth it for a small one."""


def in_own_process(library: Path, function: Callable[..., T], *args: Any) -> T:
    """`function(*args)`, which loads `library`: in a fresh process when the library is large."""
    if library.stat().st_size <= LOADED_APART_BYTES:
        return function(*args)
    with processes_with([{}]) as (process,):
        return process.submit(function, *args).result()


@contextmanager
def processes_with(environments: Sequence[Mapping[str, str | None]]) -> Iterator[list[ProcessPoolExecutor]]:
    """One fresh process per mapping, with its environment variables set (None: unset) before it imports
    anything: what TVM's runtime reads once, when its thread pool starts, differs between them."""
    pools = [ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_start_with,
                                 initargs=(dict(environment),)) for environment in environments]
    try:
        yield pools
    finally:
        for pool in pools:
            pool.shutdown()


def _start_with(environment: dict[str, str | None]) -> None:
    keep_torch_out()
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def keep_torch_out() -> None:
    """`import torch` fails from now on in this process (unless it already happened): a process that only
    compiles or runs libraries has no use for PyTorch, which TVM imports when it can (200 MB, 2 s)."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # Python's way to make an import fail


TORCH_REFUSED = ("raise ImportError('edgetune starts this process without PyTorch: TVM imports it when it can, "
                 "and nothing here uses it')\n")
"""A `torch` package's whole `__init__.py` that refuses the import, for the processes TVM itself starts."""
TORCH_REFUSED_DIR = "without-torch"
"""Its directory's name, beside an RPC server's or tracker's pid file (on the device: in its workdir)."""


def environment_without_torch(directory: Path, environment: Mapping[str, str]) -> dict[str, str]:
    """`environment`, for a process whose own children (an RPC server's or a tracker's TVM pool worker, started as
    `python -m tvm.exec.popen_worker`) also cannot import PyTorch: `directory` gets a `torch` package that
    refuses the import, first on PYTHONPATH. An RPC server (two processes, each importing TVM) registered
    with its tracker 6.8-8.2 s after its start and held 772 MB with PyTorch, 2.4-3.1 s and 380 MB without it;
    a tracker the same (7.2 against 2.3-3.2 s to answer; a 2-core VM)."""
    package = directory / "torch"
    package.mkdir(parents=True, exist_ok=True)
    init = package / "__init__.py"
    if not init.is_file() or init.read_text() != TORCH_REFUSED:
        init.write_text(TORCH_REFUSED)
    paths = [str(directory)] + ([environment["PYTHONPATH"]] if environment.get("PYTHONPATH") else [])
    return {**environment, "PYTHONPATH": os.pathsep.join(paths)}


def run_tvm_pool_worker() -> None:
    """TVM's pool worker loop, in this process, with PyTorch kept out."""
    keep_torch_out()
    from tvm.exec import popen_worker

    popen_worker.main()


if __name__ == "__main__":
    try:
        run_tvm_pool_worker()
    except (OSError, KeyboardInterrupt):  # the parent went away: as TVM's own worker does, end quietly
        pass
