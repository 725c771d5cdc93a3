"""The untuned model, compiled and exported once in a process of its own (build/untuned.py)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

import edgetune.build.untuned as untuned_module
from edgetune.build.untuned import COMPILE_BASE_BYTES, UntunedModel
from edgetune.frontend.onnx import load_model, to_relax
from edgetune.profiles import load_profile
from edgetune.selection import constant_bytes


def _tiny(tmp_path, link_compiler=lambda: None, say=lambda message: None) -> UntunedModel:
    relax_mod = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    return UntunedModel(relax_mod, load_profile("host").tvm_target(), None, tmp_path / "work" / "untuned.so",
                        link_compiler, constant_bytes(relax_mod), say)


def test_the_library_is_compiled_apart_once_while_this_process_goes_on(tmp_path) -> None:
    untuned = _tiny(tmp_path)
    started = time.monotonic()
    untuned.start()
    untuned.start()  # once
    assert time.monotonic() - started < 5  # it returns at once: the compile runs in the other process
    assert len(multiprocessing.active_children()) == 1

    library = untuned.library()

    assert library == tmp_path / "work" / "untuned.so" and library.stat().st_size > 0
    assert untuned.library() == library and not multiprocessing.active_children()  # ended, not compiled again


def test_a_compile_that_fails_apart_is_run_again_here_and_raises_its_own_error(tmp_path) -> None:
    """The process says nothing of why it failed; the build's error is the one this process raises."""
    untuned = _tiny(tmp_path, link_compiler=lambda: str(tmp_path / "no-such-cc"))
    untuned.start()
    with pytest.raises(Exception, match="no-such-cc"):
        untuned.library()
    assert not (tmp_path / "work" / "untuned.so").exists()


def test_closing_ends_a_compile_under_way(tmp_path) -> None:
    """A target that failed or was stopped does not wait for its untuned model."""
    untuned = _tiny(tmp_path)
    untuned.start()
    untuned.close()
    assert not multiprocessing.active_children()
    untuned.close()  # twice is harmless


def test_without_the_memory_for_two_compiles_it_is_compiled_here_and_said(tmp_path, monkeypatch) -> None:
    """Compiling apart holds a second compile's memory (1.38 GB for an untuned ResNet-50): only where it is free."""
    said: list[str] = []
    untuned = _tiny(tmp_path, say=said.append)
    monkeypatch.setattr(untuned_module, "free_memory_bytes", lambda: COMPILE_BASE_BYTES)

    untuned.start()
    assert not multiprocessing.active_children()
    library = untuned.library()  # compiled here, now

    assert library.stat().st_size > 0 and not multiprocessing.active_children()
    assert len(said) == 1 and "two compiles at once would need 2.1 GB" in said[0], said
