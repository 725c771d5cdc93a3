"""Run what loads a large compiled library in a process of its own, so its weights go when that process ends.

TVM never unloads a library it loaded: its weights stay in the process for good. A ResNet-50 build loaded
three (tuned, untuned, the packaged one), 240 MB each, and peaked at 1.9 GB for 100 MB of weights. This
module imports no TVM, so the process it starts imports only what the function it runs needs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
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
    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_without_torch) as pool:
        return pool.submit(function, *args).result()


def _without_torch() -> None:
    """A process that only runs a library has no use for PyTorch, which TVM imports when it can (200 MB)."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # Python's way to make an import fail
