"""Choosing each kernel's schedule by its time inside the compiled model, not by the tuner's ranking."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import tvm
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.database import TuningRecord

from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
from edgetune.profiles import load_profile
from edgetune.selection import DEFAULT_RANK, select_schedules
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.tasks import extract_tasks


def test_a_kernel_the_tuner_ranked_first_but_slow_in_the_model_gives_way(tmp_path):
    relax_mod, target, store, heaviest, inputs, as_written = _strided_ranked_first(tmp_path)
    before = {p.name: p.read_bytes() for p in store.directory.iterdir()}

    selection = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2)

    choice = selection.choices[heaviest.name]
    assert choice.rank in (1, DEFAULT_RANK), choice  # the loops as written: recorded at rank 1, or by default
    assert choice.in_model_us < choice.tuner_best_in_model_us / 2, choice
    assert selection.models_compiled == 3  # the tuner's best, the defaults, rank 1
    chosen = selection.database.get_top_k(selection.database.commit_workload(heaviest.mod), 5)
    assert [str(r.trace) for r in chosen] == ([str(as_written.trace)] if choice.rank == 1 else [])
    assert {p.name: p.read_bytes() for p in store.directory.iterdir()} == before  # the store is only read


def test_the_default_schedules_are_timed_in_the_untuned_model_compiled_apart(tmp_path, monkeypatch):
    """The build compiles the untuned model once, in a process of its own beside the tuner's best's compile
    (build/untuned.py); the comparison asks for it before timing anything (a compile beside a timing disturbs
    it) and times the default schedules in it, compiling no model for them. The library compiled apart is the
    untuned model, output for output."""
    import numpy as np

    import edgetune.selection as selection_module
    from edgetune.build.untuned import UntunedModel
    from edgetune.compile import compile_model, export_library

    relax_mod, target, store, heaviest, inputs, _ = _strided_ranked_first(tmp_path, schedules=1)
    apart = UntunedModel(relax_mod, target, None, tmp_path / "work" / "untuned.so", lambda: None, weight_bytes=0)
    events: list[str] = []
    real_compile, real_kernel_times = selection_module.compile_model, selection_module._kernel_times

    def compiled(*args, **kwargs):
        events.append("compile")
        return real_compile(*args, **kwargs)

    def timed(*args, **kwargs):
        events.append("timing")
        return real_kernel_times(*args, **kwargs)

    def untuned() -> Path:
        events.append("untuned")
        return apart.library()

    monkeypatch.setattr(selection_module, "compile_model", compiled)
    monkeypatch.setattr(selection_module, "_kernel_times", timed)
    apart.start()
    selection = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=4,
                                 untuned=untuned)

    assert events[:3] == ["compile", "untuned", "timing"] and events.count("untuned") == 1
    assert events.count("compile") == 2  # the tuner's best and the chosen model, none for the default schedules
    assert selection.models_compiled == 2 and selection.choices[heaviest.name].rank == DEFAULT_RANK
    library = apart.library()
    assert library == tmp_path / "work" / "untuned.so" and library.is_file()
    here = export_library(compile_model(relax_mod, target, None), tmp_path / "compiled-here.so")
    # Run apart: after this fixture's selection, running a model in the same process has crashed TVM.
    for apart_output, here_output in zip(_outputs_apart(library, inputs), _outputs_apart(here, inputs)):
        np.testing.assert_array_equal(apart_output, here_output)


def test_each_rank_is_timed_in_turns_with_the_tuners_best(tmp_path, monkeypatch):
    """The tuner's best model stays loaded and runs between the other ranks' rounds, so both sides of each
    comparison meet the machine in the same state; every kernel's choice compares times taken in turns."""
    import edgetune.selection as selection_module

    relax_mod, target, store, heaviest, inputs, _ = _strided_ranked_first(tmp_path)
    sequence: list[tuple[int, int]] = []  # (id of the model's VM, inferences) per timing call
    timed_vms = []  # kept alive: a freed VM's id may be given to the next one (the suite once saw 1 VM for 2)
    real_kernel_times = selection_module._kernel_times

    def recorded(vm, arguments, runs, max_s=None):
        timed_vms.append(vm)
        sequence.append((id(vm), runs))
        return real_kernel_times(vm, arguments, runs, max_s)

    monkeypatch.setattr(selection_module, "_kernel_times", recorded)
    selection = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2, runs=12)

    best_vm = sequence[0][0]
    others = [vm for vm, _ in sequence if vm != best_vm]
    assert len(set(others)) == 2 and selection.models_compiled == 3  # the defaults and rank 1, each against it
    rank_one = [index for index, (vm, _) in enumerate(sequence) if vm == others[-1]]
    assert len(rank_one) == 3 and all(sequence[i][1] == 4 for i in rank_one)  # three rounds of 12 / 3 runs
    assert all(best_vm in (sequence[i - 1][0], sequence[i + 1][0] if i + 1 < len(sequence) else None)
               for i in rank_one)  # each round of rank 1 next to one of the tuner's best
    choice = selection.choices[heaviest.name]
    assert choice.rank in (1, DEFAULT_RANK) and choice.in_model_us < choice.tuner_best_in_model_us / 2, choice


def test_the_chosen_model_stands_only_if_it_runs_faster_whole_and_ships_as_compiled(tmp_path, monkeypatch):
    """Choices made kernel by kernel are compiled into one model and timed whole, in turns with the tuner's
    best: the faster of the two is the library the build ships, as the comparison compiled it. Every model is
    compiled as the final compile compiles it and loaded from its library, never in memory: relax's VM links
    such a model again to run it (6.7 s of a MobileNet-V2's rank), and the tuner's best had been linked twice."""
    import edgetune.selection as selection_module

    def in_memory(*args, **kwargs):
        raise AssertionError("compiled in memory")

    monkeypatch.setattr(selection_module, "compile_model", in_memory)
    relax_mod, target, store, heaviest, inputs, _ = _strided_ranked_first(tmp_path)
    libraries = tmp_path / "work"
    libraries.mkdir()

    changed = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2,
                               libraries=libraries)
    assert changed.choices[heaviest.name].rank != 0  # the strided schedule loses, in the kernel and whole
    assert changed.verified_ratio is not None and changed.verified_ratio < 0.5
    assert changed.library == libraries / "model-chosen.so"
    assert sorted(p.name for p in libraries.iterdir()) == ["model-best.so", "model-chosen.so"]  # ranks removed

    only_best = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2,
                                 deadline=time.monotonic(), libraries=libraries)  # nothing else fits: rank 0 kept
    assert only_best.choices[heaviest.name].rank == 0 and only_best.models_compiled == 1
    assert only_best.verified_ratio is None and only_best.library == libraries / "model-best.so"


def test_a_choice_slower_as_a_whole_model_gives_way_to_the_tuners_best(tmp_path, monkeypatch):
    """Where the whole chosen model runs slower than the tuner's best (kernels timed in different models need
    not add up), every kernel keeps the tuner's best and its library ships; the chosen one is removed."""
    import edgetune.selection as selection_module

    relax_mod, target, store, heaviest, inputs, _ = _strided_ranked_first(tmp_path)
    monkeypatch.setattr(selection_module, "_model_ratio", lambda best, chosen, runs: 1.02)  # as timed in a slow spell
    kept = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2, libraries=tmp_path)

    assert kept.verified_ratio == 1.02 and kept.library == tmp_path / "model-best.so"
    assert kept.library.is_file() and not (tmp_path / "model-chosen.so").exists()
    assert kept.choices[heaviest.name].rank == 0 and kept.in_model_us == kept.tuner_best_in_model_us
    assert len(kept.database.get_all_tuning_records()) == 1  # the strided schedule, the tuner's best


def _outputs_apart(library: Path, inputs: list) -> list:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from edgetune.package.verify import library_outputs

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(library_outputs, library, "cpu", inputs).result()


def test_past_the_deadline_only_the_tuners_best_is_compiled(tmp_path):
    relax_mod, target, store, heaviest, inputs, _ = _strided_ranked_first(tmp_path)

    selection = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2,
                                 deadline=time.monotonic(), untuned=lambda: tmp_path / "unused")

    assert selection.models_compiled == 1
    assert selection.choices[heaviest.name].rank == 0
    assert selection.in_model_us == selection.tuner_best_in_model_us > 0


@pytest.mark.serial
def test_near_the_deadline_the_default_schedules_model_needs_room_for_its_timing_only(tmp_path, monkeypatch):
    """The default schedules' model is the untuned one, which the build compiles apart anyway: it is compared
    when its timing fits before the deadline, while a further rank needs room for its compile and the chosen
    model's after it. Each compile here takes 6 s more (a slow compile), so a rank takes about 7 s: the default's
    timing fits by 18 s, another rank's compile and the chosen model's would not."""
    import edgetune.selection as selection_module
    from edgetune.compile import compile_library, export_untuned

    relax_mod, target, store, _, inputs, _ = _strided_ranked_first(tmp_path)
    untuned = export_untuned(relax_mod, target, None, tmp_path / "untuned.so", None)
    slow_s = 6.0

    def slow_compile(*args, **kwargs) -> Path:
        time.sleep(slow_s)
        return compile_library(*args, **kwargs)

    monkeypatch.setattr(selection_module, "compile_library", slow_compile)
    selection = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=2,
                                 deadline=time.monotonic() + 3 * slow_s, untuned=lambda: untuned,
                                 libraries=tmp_path)

    assert selection.models_compiled == 2  # the tuner's best and the default schedules' model
    assert selection.stopped_by_deadline  # rank 1 and the chosen model did not fit


def test_a_kernel_whose_only_tuned_schedule_is_slower_keeps_its_default(tmp_path):
    relax_mod, target, store, heaviest, inputs, _ = _strided_ranked_first(tmp_path, schedules=1)

    selection = select_schedules(relax_mod, target, store.database, inputs, tvm.cpu(0), candidates=4)

    choice = selection.choices[heaviest.name]
    assert choice.rank == DEFAULT_RANK, choice
    assert choice.in_model_us < choice.tuner_best_in_model_us / 2, choice
    assert selection.models_compiled == 2
    assert selection.database.get_top_k(selection.database.commit_workload(heaviest.mod), 5) == []


def test_with_one_schedule_per_kernel_it_is_compared_with_the_default(tmp_path):
    model = load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None)
    relax_mod = to_relax(model)
    target = load_profile("host").tvm_target()
    store = RecordStore(tmp_path / "records")
    for task in extract_tasks(fuse_for_tuning(relax_mod, target), target):
        workload = store.database.commit_workload(task.mod)
        args = ArgInfo.from_entry_func(task.mod, remove_preproc=True)
        store.database.commit_tuning_record(
            TuningRecord(_untouched(task.mod).trace, workload, [1e-4], target, args))

    selection = select_schedules(relax_mod, target, store.database, [model.sample_inputs()["data"]], tvm.cpu(0),
                                 candidates=4)

    assert selection.models_compiled == 2  # with the records, and with every kernel's default
    kept = len(selection.database.get_all_tuning_records())
    assert kept == len(store.database.get_all_tuning_records()) - sum(
        c.rank == DEFAULT_RANK for c in selection.choices.values())


def _strided_ranked_first(tmp_path, schedules: int = 2):
    """tiny_cnn at 224x224 and a store ranking, for its heaviest kernel (a 3x3 convolution, 22 MFLOP per
    call), a schedule with every access strided first and (unless `schedules` is 1) the kernel as written
    second."""
    model = load_model(zoo="tiny_cnn", onnx_path=None, input_shapes={"data": [1, 3, 224, 224]})
    relax_mod = to_relax(model)
    target = load_profile("host").tvm_target()
    heaviest = extract_tasks(fuse_for_tuning(relax_mod, target), target)[0]
    as_written = _untouched(heaviest.mod)
    strided = _untouched(heaviest.mod)  # the same loops with the image rows innermost
    _n, h, w, co, rh, rw, ci = strided.get_loops(strided.get_sblock("conv2d_nhwc"))
    strided.reorder(co, rh, rw, ci, w, h)

    store = RecordStore(tmp_path / "records")
    workload = store.database.commit_workload(heaviest.mod)
    args = ArgInfo.from_entry_func(heaviest.mod, remove_preproc=True)
    # Ranked by the times "measured" here, the strided schedule is the tuner's best; in the model it is not.
    for schedule, seconds in ((strided, 1e-6), (as_written, 1e-3))[:schedules]:
        store.database.commit_tuning_record(TuningRecord(schedule.trace, workload, [seconds], target, args))
    return relax_mod, target, store, heaviest, [model.sample_inputs()["data"]], as_written


def _untouched(mod: tvm.IRModule) -> tvm.s_tir.Schedule:
    """The kernel as written, with a trace of one no-op: MetaSchedule's databases skip empty traces."""
    schedule = tvm.s_tir.Schedule(mod)
    schedule.get_sblock("root")
    return schedule


def test_the_reserves_compile_and_run_leave_out_the_wait_between_them(tmp_path):
    """The budget's reserve times one compile and run of the model while the untuned model compiles apart
    beside it; the run waits for that compile (`before_timing`), and the wait is neither compile nor run."""
    from edgetune.selection import rank_cost

    relax_mod, target, store, _, inputs, _ = _strided_ranked_first(tmp_path)
    waits: list[float] = []

    def wait() -> None:
        waits.append(time.monotonic())
        time.sleep(2.0)

    started = time.monotonic()
    cost = rank_cost(relax_mod, target, store.database, inputs, tvm.cpu(0), before_timing=wait)
    elapsed = time.monotonic() - started

    assert len(waits) == 1 and started + cost.compile_s <= waits[0] + 0.1
    assert cost.compile_s + cost.run_s < elapsed - 1.9


def test_on_fewer_threads_a_schedule_that_runs_on_one_core_does_not_win_by_its_one_thread_time():
    """Beside a busy program the models are timed on one thread of two, where a kernel whose parallel loop has one
    iteration runs as fast as one that splits over both; scaled to the target's threads, the tuner's best (8
    iterations) keeps its place against a one-core schedule 20% faster on one thread (1.6x slower on two). A
    record whose trace does not replay counts as of unknown split."""
    from tvm import te
    from tvm.s_tir.meta_schedule.database import Workload

    from edgetune.selection import _fastest, _parallel_extent, _scaled_to_target_threads

    a = te.placeholder((8, 64), name="a")
    mod = tvm.IRModule({"main": te.create_prim_func([a, te.compute((8, 64), lambda i, j: a[i, j] + 1.0)])})
    split, one_core = tvm.s_tir.Schedule(mod), tvm.s_tir.Schedule(mod)
    split.parallel(split.get_loops(split.get_sblock("compute"))[0])
    records = [TuningRecord(s.trace, Workload(mod), [1e-5]) for s in (split, one_core)]
    ratios = {0: {7: 1.0}, 1: {7: 0.8}, DEFAULT_RANK: {7: 1.1}}
    assert _fastest(7, 2, ratios) == 1  # by the one-thread times

    _scaled_to_target_threads(ratios, {7: records}, threads=1, cpu_threads=2)

    assert ratios == {0: {7: 1.0}, 1: {7: pytest.approx(1.6)}, DEFAULT_RANK: {7: pytest.approx(1.1)}}
    assert _fastest(7, 2, ratios) == 0
    other = tvm.IRModule({"main": te.create_prim_func([a, te.compute((8, 64), lambda i, j: a[i, j] * 2.0,
                                                                     name="other")])})
    stale = tvm.s_tir.Schedule(other)
    stale.parallel(stale.get_loops(stale.get_sblock("other"))[0])
    assert _parallel_extent(TuningRecord(stale.trace, Workload(other), [1e-5])) == 8
    assert _parallel_extent(TuningRecord(stale.trace, Workload(mod), [1e-5])) is None  # a trace that does not replay
