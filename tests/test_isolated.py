"""A large library is loaded in a process of its own (TVM never frees a library it loaded), and gives the same
outputs there; that process does not import PyTorch. A build hands freed memory back only once it holds much."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from edgetune import isolated
from edgetune.isolated import in_own_process


def _outputs_and_process(library: Path, inputs: list[np.ndarray]) -> tuple[int, bool, list[np.ndarray]]:
    from edgetune.package.verify import library_outputs

    torch_loaded = sys.modules.get("torch") is not None
    return os.getpid(), torch_loaded, library_outputs(library, "cpu", inputs)


def test_a_large_library_runs_in_a_process_of_its_own(tiny_build, monkeypatch) -> None:
    directory, _ = tiny_build
    library = directory / "out" / "tiny" / "host" / "model.so"
    with np.load(directory / "out" / "tiny" / "host" / "sample_input.npz") as sample:
        inputs = [sample[name] for name in sample.files]

    monkeypatch.setattr(isolated, "LOADED_APART_BYTES", 0)  # every library counts as large
    pid, torch_loaded, apart = in_own_process(library, _outputs_and_process, library, inputs)
    assert pid != os.getpid() and not torch_loaded

    monkeypatch.setattr(isolated, "LOADED_APART_BYTES", library.stat().st_size)  # this one is small
    pid, _, here = in_own_process(library, _outputs_and_process, library, inputs)
    assert pid == os.getpid()
    assert len(apart) == len(here) and all(np.array_equal(a, h) for a, h in zip(apart, here))


def test_freed_memory_is_handed_back_only_by_a_process_that_holds_much(monkeypatch) -> None:
    """A full collection at each stage's end cost a tiny build 0.2 s a stage; a large model's build needs it."""
    import gc

    from edgetune import runtime

    collections: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or 0)
    monkeypatch.setattr(runtime, "RELEASE_ABOVE_BYTES", 1 << 50)
    runtime.release_freed_memory()
    assert collections == []
    monkeypatch.setattr(runtime, "RELEASE_ABOVE_BYTES", 1)
    runtime.release_freed_memory()
    assert collections == [1]
