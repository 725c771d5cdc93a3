"""The untuned model, compiled and exported once: a large one in a process of its own (build/untuned.py)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

import edgetune.build.untuned as untuned_module
from edgetune.build.untuned import (
    APART_MIN_CALLS,
    APART_MIN_WEIGHT_BYTES,
    COMPILE_BASE_BYTES,
    UntunedModel,
    compile_apart_pays,
)
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
    assert untuned.compiling_apart  # what the reserve's compile beside it is told (selection.rank_cost)

    library = untuned.library()

    assert library == tmp_path / "work" / "untuned.so" and library.stat().st_size > 0
    assert not untuned.compiling_apart
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


def _chain(path, relus: int, weight_floats: int):
    """`relus` Relu calls in a row, then one Add of a constant of `weight_floats` floats."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Relu", [f"x{i}"], [f"x{i + 1}"]) for i in range(relus)]
    nodes.append(helper.make_node("Add", [f"x{relus}", "w"], ["y"]))
    weight = numpy_helper.from_array(np.ones(weight_floats, dtype=np.float32), "w")
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [weight_floats])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [weight_floats])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return to_relax(load_model(zoo=None, onnx_path=path, input_shapes=None))


def test_only_a_model_whose_compile_outlasts_a_process_start_is_compiled_apart(tmp_path) -> None:
    """A process apart costs TVM's import (1.9 s of CPU); tiny_cnn compiles in under a second."""
    tiny = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    assert not compile_apart_pays(tiny, constant_bytes(tiny))
    few = _chain(tmp_path / "few.onnx", APART_MIN_CALLS - 2, 4)
    many = _chain(tmp_path / "many.onnx", APART_MIN_CALLS, 4)
    heavy = _chain(tmp_path / "heavy.onnx", 1, APART_MIN_WEIGHT_BYTES // 4)
    assert not compile_apart_pays(few, constant_bytes(few))
    assert compile_apart_pays(many, constant_bytes(many))
    assert compile_apart_pays(heavy, constant_bytes(heavy))


def test_a_model_not_worth_a_process_is_compiled_here_when_first_asked_for(tmp_path) -> None:
    relax_mod = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    untuned = UntunedModel(relax_mod, load_profile("host").tvm_target(), None, tmp_path / "untuned.so",
                           lambda: None, constant_bytes(relax_mod), apart=False)
    untuned.start()
    assert not multiprocessing.active_children() and not (tmp_path / "untuned.so").exists()
    assert not untuned.compiling_apart
    assert untuned.library() == tmp_path / "untuned.so" and (tmp_path / "untuned.so").stat().st_size > 0
    assert not multiprocessing.active_children()


def test_it_is_timed_once_per_build_by_whichever_stage_asks_first(tmp_path) -> None:
    """A budget's reserve times it where the library is ready (its time is then known, not guessed from the tuned
    model's), and the measure stage reports that timing instead of timing it again."""
    untuned = _tiny(tmp_path)
    timed = []

    def time_library(library) -> float:
        timed.append(library)
        return 1.5

    assert untuned.latency_ms(time_library) == 1.5
    assert untuned.latency_ms(lambda library: 99.0) == 1.5
    assert timed == [tmp_path / "work" / "untuned.so"] and timed[0].stat().st_size > 0
