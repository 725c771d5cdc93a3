"""A CPU model's kernels are built in groups in two processes and linked into one library (compile.py's
`compile_library`): the model computes what `compile_model`'s library computes, and the library's bytes do
not depend on how many processes built it."""

from __future__ import annotations

import hashlib
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from conftest import library_outputs, tiny_build_inputs


def _compile_in_a_daemon(directory: str, path: str) -> None:
    """What build/untuned.py's compile apart does: compile_library in a daemon process, which may start none."""
    from edgetune.compile import compile_library

    _, relax_mod, target, store = tiny_build_inputs(Path(directory))
    compile_library(relax_mod, target, store.database, Path(path))


@pytest.mark.slow
def test_kernels_built_in_groups_compute_what_one_build_computes_and_give_the_same_bytes_anywhere(tiny_build,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """The tiny model's groups built in two processes (as a model of 40 operators or more has them), again, and in
    a daemon process alone (as a smaller model has them, in any process)."""
    from edgetune import compile as compiling
    from edgetune import isolated

    monkeypatch.setattr(compiling, "HELPED_MIN_OPERATORS", 0)
    started = []
    processes_with = isolated.processes_with
    monkeypatch.setattr(isolated, "processes_with", lambda environments: started.append(len(environments))
                        or processes_with(environments))
    directory, _ = tiny_build
    model, relax_mod, target, store = tiny_build_inputs(directory)
    grouped = compiling.compile_library(relax_mod, target, store.database, tmp_path / "grouped.so")
    whole = compiling.export_library(compiling.compile_model(relax_mod, target, store.database), tmp_path / "one.so")
    assert np.array_equal(library_outputs(grouped, model), library_outputs(whole, model))
    assert started == [compiling.KERNEL_GROUPS - 1]  # a second process built a group

    again = compiling.compile_library(relax_mod, target, store.database, tmp_path / "again.so")
    daemon = multiprocessing.get_context("spawn").Process(target=_compile_in_a_daemon, daemon=True,
                                                         args=(str(directory), str(tmp_path / "daemon.so")))
    daemon.start()
    daemon.join()
    assert daemon.exitcode == 0
    digests = {hashlib.sha256(path.read_bytes()).hexdigest() for path in
               (grouped, again, tmp_path / "daemon.so")}
    assert len(digests) == 1  # two processes, and one alone (a daemon), build the same bytes

    kernels = compiling._lowered_for_vm(relax_mod, target, store.database, None, None)[1]
    groups = compiling._kernel_groups(kernels, compiling.KERNEL_GROUPS)
    assert len(groups) == compiling.KERNEL_GROUPS  # both processes had kernels to build
    symbols = set(grouped.read_bytes().split(b"\0"))
    assert all(gvar.name_hint.encode() in symbols for gvar in kernels.get_global_vars())
