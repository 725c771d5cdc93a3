"""The untuned model, compiled and exported once in a process of its own (build/untuned.py)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from edgetune.build.untuned import UntunedModel
from edgetune.frontend.onnx import load_model, to_relax
from edgetune.profiles import load_profile


def _tiny(tmp_path, link_compiler=lambda: None) -> UntunedModel:
    relax_mod = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    return UntunedModel(relax_mod, load_profile("host").tvm_target(), None, tmp_path / "work" / "untuned.so",
                        link_compiler)


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
