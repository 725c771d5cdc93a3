"""Choose each kernel's schedule among the tuner's few best by its time inside the compiled model.

The tuner times a kernel alone, and alone it runs with other caches and neighbours than in the
model: on this CPU a tuned MobileNet-V2 kernel's time in the model was 0.63-1.30x its tuned time,
and the tuner's second- or fourth-best schedule was often the fastest in the model. So the model is
compiled once per rank (every kernel with the tuner's i-th best schedule), each kernel is timed where
it runs, in the model, and each kernel keeps the schedule that ran fastest there. Each rank's model is
timed in turns with the tuner's best, which stays loaded, and judged by its kernels' times relative to it:
this machine's speed drifts for seconds at a time, and a rank timed alone in a slow spell loses (or wins)
every kernel at once. The record store is only read: what is chosen lives in the returned database.

The kernel's default schedule (no record: the same pipeline with nothing applied) is one more candidate,
timed right after the tuner's best: a few trials of a small kernel can all be slower than the loops
as written (the corpus transformer block, 2 trials per task, ran at 0.028 ms against 0.011 ms
untuned), and no kernel ships slower in the model than its default.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime.vm import VMInstrumentReturnKind
from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.database import Database, MemoryDatabase, TuningRecord, Workload
from tvm.s_tir.meta_schedule.relax_integration import extract_tasks as ms_extract_tasks

from edgetune.compile import compile_library, compile_model
from edgetune.frontend.onnx import fuse_for_tuning
from edgetune.frontend.winograd import WinogradPolicy
from edgetune.runtime import in_turns
from edgetune.tuning.analyzer.space import TVM_ERRORS
from edgetune.tuning.analyzer.tir import parallel_extent, thread_share
from edgetune.tuning.database.store import commit_record
from edgetune.tuning.measurements import FAILED, mean_seconds
from edgetune.tuning.tasks import MODULE_EQUALITY

_PREPACKED = "_prepacked"
"""Suffix compile_model's weight pre-packing gives a kernel's name."""


DEFAULT_RANK = -1
"""KernelChoice.rank of a kernel that keeps its default schedule: every tuned one ran slower in the model."""

_DEFAULT_TIMING_SHARE = 2.0
"""The default schedules' model is timed for at most twice as long as the tuner's best took: untuned,
a ResNet-50 runs 160x slower (5.9 s per inference), and 30 runs of it took 3 minutes of a 6-minute budget.
Where the default is that slow one run settles it; where it is close, as fast runs fit in the time."""

DEFAULT_MARGIN = 0.03
"""The default schedule replaces the fastest tuned one, and another tuned schedule the tuner's best, only when
it is faster by more than this fraction: timing noise inside the model is a few percent (three comparisons
in turns on one ResNet-18 store, with any faster rank taken, chose models 1.024x, 1.026x and 1.001x the
tuner's best's time), and a tie keeps the tuner's best."""


@dataclass(frozen=True)
class KernelChoice:
    rank: int
    """The chosen schedule's rank by the tuner's own timing; 0 is the tuner's best, DEFAULT_RANK its default."""
    in_model_us: float
    """Its time per inference inside the model, over all calls of the kernels sharing its schedule."""
    tuner_best_in_model_us: float
    """The tuner's best schedule's time in the model, measured the same way."""


@dataclass(frozen=True)
class Selection:
    database: MemoryDatabase
    """One record per workload of the model: the one to compile with."""
    choices: dict[str, KernelChoice]
    """By kernel (task) name; empty when no kernel had two schedules to compare."""
    models_compiled: int
    seconds: float
    in_model_us: float = 0.0
    """The compared kernels' time per inference in the model with the chosen schedules..."""
    tuner_best_in_model_us: float = 0.0
    """...and with the tuner's best ones."""
    stopped_by_deadline: bool = False
    """Fewer ranks were compared than the records had: the next would not have fit before the deadline."""
    library: Path | None = None
    """The model compiled with `database`, as the comparison compiled it into `libraries` (None: not compiled
    so; compile it)."""
    verified_ratio: float | None = None
    """The chosen schedules' model's time over the tuner's best's, each whole model timed in turns; the
    choice stands where it is below 1, else every kernel keeps the tuner's best (None: nothing changed)."""


def select_schedules(relax_mod: tvm.IRModule, target: tvm.target.Target, database: Database,
                     inputs: list[np.ndarray], device: tvm.runtime.Device, candidates: int,
                     winograd: WinogradPolicy | None = None, runs: int = 30,
                     deadline: float | None = None, untuned: Callable[[], Path] | None = None,
                     libraries: Path | None = None, cross_compiler: Any = None,
                     on_skip: Callable[[str], None] | None = None,
                     threads: tuple[int, int] | None = None) -> Selection:
    """The model's kernels each with the fastest in the model of their `candidates` best schedules and
    their default one.

    Runs the model on `device` in this process, so it is for targets measured on this machine. The
    tuner's best model stays loaded, and each other rank's model is timed against it in turns
    (`_PAIRED_ROUNDS`), so a slow spell of the machine slows both sides of a comparison, not one rank.
    `deadline` (a `time.monotonic()` instant, the end of a tuning budget): after the tuner's best, the default
    schedules' model is timed only if that timing still fits before it (its compile too, without `untuned`), and a
    further rank only if its compile and timing in turns fit with the model of the kernels' choices (compiled and
    timed whole after the last rank), each compile as long as the tuner's best's took. `untuned` gives the default
    schedules' model, which is the untuned one, as the build compiled it apart (build/untuned.py): called before
    anything is timed, as it waits for that compile (None: the default schedules' model is compiled here). Where
    the kernels' choices differ from the tuner's best, the model they make is compiled and timed whole, in turns
    with the tuner's best, and kept only if it runs faster: choices made kernel by kernel in models that each
    changed every kernel need not add up. `libraries`, `cross_compiler`: see `_ModelCompiler`; the library of the
    model that stands is returned to ship. `on_skip`: as in `compile_model`, for the tuner's best and the chosen.
    `threads`: (the threads the models run on here, the target's): fewer where other programs held cores, and
    then the kernels' ratios are scaled to the target's threads (`_scaled_to_target_threads`)."""
    start = time.monotonic()
    records = _in_memory(database)
    fused = fuse_for_tuning(relax_mod, target, winograd)
    workload_of = {k.task_name: records.commit_workload(k.dispatched[0]) for k in ms_extract_tasks(fused, target)}
    ranked = {_key(w): _usable(records.get_top_k(w, candidates)) for w in workload_of.values()}
    ranked = {key: top for key, top in ranked.items() if top}
    if not ranked:
        return Selection(_pick(ranked, {}), {}, 0, time.monotonic() - start)

    compiler = _ModelCompiler(relax_mod, target, winograd, libraries, cross_compiler, on_skip)
    arguments = [tvm.runtime.tensor(x, device) for x in inputs]
    compile_started = time.monotonic()
    model, best_library = compiler.compile(_pick(ranked, dict.fromkeys(ranked, 0)), "best")
    compile_s = time.monotonic() - compile_started
    default_library = untuned() if untuned is not None else None  # its compile apart ends before any timing
    timing_started = time.monotonic()
    best = _TimedModel(model, device, arguments, workload_of)
    del model  # the timed model holds it
    best_us = best.kernel_times(runs)
    timing_s = time.monotonic() - timing_started
    rank_s = compile_s + 2 * timing_s  # a rank's compile, and its kernels timed in turns with the best's
    comparison = _Comparison(best_us)
    stopped = False
    for rank in [DEFAULT_RANK, *range(1, max(map(len, ranked.values())))]:
        started, apart = time.monotonic(), rank == DEFAULT_RANK and default_library is not None
        # compiled apart, the default schedules' model is only timed (RankCost.default_s); a rank other than the
        # default brings the chosen model's compile and timing after it
        needed_s = (1 + _DEFAULT_TIMING_SHARE) * timing_s if apart else rank_s + (compile_s + timing_s) * (rank > 0)
        if deadline is not None and started + needed_s > deadline:
            stopped = True
            break
        model, library = ((tvm.runtime.load_module(str(default_library)), None) if apart else
                          compiler.compile(_pick(ranked, dict.fromkeys(ranked, rank)), f"rank{rank}", warn=False))
        other = _TimedModel(model, device, arguments, workload_of)
        del model
        max_s = _DEFAULT_TIMING_SHARE * runs * sum(best_us.values()) / 1e6 if rank == DEFAULT_RANK else None
        comparison.ratios[rank] = _in_turns(best, other, runs, max_s)
        del other  # the next rank's compile needs the memory of this one's weights
        compiler.remove(library)
        rank_s = rank_s if apart else time.monotonic() - started  # what the next rank's compile and timing take
    if threads is not None and threads[0] < threads[1]:
        _scaled_to_target_threads(comparison.ratios, ranked, *threads)
    selection = comparison.selection(ranked, workload_of, time.monotonic() - start, stopped)
    if all(choice.rank == 0 for choice in selection.choices.values()):
        return dataclasses.replace(selection, library=best_library)
    model, chosen_library = compiler.compile(selection.database, "chosen")
    ratio = _model_ratio(best, _TimedModel(model, device, arguments, workload_of), runs)
    del model
    if ratio < 1.0:
        return dataclasses.replace(selection, library=chosen_library, verified_ratio=ratio,
                                   seconds=time.monotonic() - start)
    compiler.remove(chosen_library)
    kept = comparison.selection(ranked, workload_of, time.monotonic() - start, stopped, only_best=True)
    return dataclasses.replace(kept, library=best_library, verified_ratio=ratio)


@dataclass(frozen=True)
class _ModelCompiler:
    """How the comparison compiles each model it times. With `libraries` (a directory), as the final compile
    does: a library of the target (`compile_library`, kernels built in groups at once; `cross_compiler` links
    it), loaded to run; the tuner's best stays as model-best.so, the kernels' choices as model-chosen.so.
    Without (a CUDA target), in memory (`compile_model`), and relax's VM links such a model again when it loads
    it: a MobileNet-V2 took 6.9 s to compile and 6.7 s more to load so, 0.02 s loaded from its library, and
    its tuner's best, exported to be shipped, had been linked twice."""

    relax_mod: tvm.IRModule
    target: tvm.target.Target
    winograd: WinogradPolicy | None
    libraries: Path | None
    cross_compiler: Any
    on_skip: Callable[[str], None] | None

    def compile(self, records: Database, name: str, warn: bool = True) -> tuple[Any, Path | None]:
        """(the model to run, its library or None); `warn`: tell `on_skip` of schedules that do not replay."""
        on_skip = self.on_skip if warn else None
        if self.libraries is None:
            return compile_model(self.relax_mod, self.target, records, self.winograd, on_skip), None
        library = compile_library(self.relax_mod, self.target, records, self.libraries / f"model-{name}.so",
                                  self.winograd, self.cross_compiler, on_skip)
        return tvm.runtime.load_module(str(library)), library

    @staticmethod
    def remove(library: Path | None) -> None:
        """A compared model's library, once timed: its weights' bytes are not shipped."""
        if library is not None:
            library.unlink(missing_ok=True)


def _model_ratio(best: _TimedModel, chosen: _TimedModel, runs: int) -> float:
    """The chosen model's time per inference over the tuner's best's: the median over rounds in turns."""
    per_round = max(1, runs // _PAIRED_ROUNDS)
    pairs = in_turns(lambda: chosen.inference_seconds(per_round), lambda: best.inference_seconds(per_round),
                     _PAIRED_ROUNDS)
    return median(theirs / ours for theirs, ours in pairs)


_PAIRED_ROUNDS = 3
"""Rounds in which a rank's model and the tuner's best take turns. This VM's speed drifts by 10-60% for
seconds at a time (a ResNet-18 ran 12.3-20.8 ms in 500 windows of 10 runs, in spells); timed one after the
other, the tuner's best, timed first after tuning, once came out at 23.0 ms against its 12.5 and every kernel
changed rank: the model shipped 3% slower than the tuner's best (timed in turns afterwards)."""


class _TimedModel:
    """One compiled model loaded on the device (an executable compiled here, or a library loaded), whose
    kernels are timed inside it, per tuned workload."""

    def __init__(self, executable, device: tvm.runtime.Device, arguments: list,
                 workload_of: dict[str, Workload]) -> None:
        self.vm = relax.VirtualMachine(executable, device)
        self.arguments = arguments
        self.workload_of = workload_of
        self.vm["main"](*arguments)  # the first call allocates

    def kernel_times(self, runs: int, max_s: float | None = None) -> dict[int, float]:
        return _per_workload(_kernel_times(self.vm, self.arguments, runs, max_s), self.workload_of)

    def inference_seconds(self, runs: int) -> float:
        """Median seconds of a whole inference, without the per-kernel instrument."""
        self.vm.set_instrument(None)
        samples = []
        for _ in range(runs):
            started = time.perf_counter()
            self.vm["main"](*self.arguments)
            samples.append(time.perf_counter() - started)
        return median(samples)


def _in_turns(best: _TimedModel, other: _TimedModel, runs: int, max_s: float | None) -> dict[int, float]:
    """Each workload's time in `other` as a ratio to its time in `best`: the median over rounds in which the
    two take turns. A model slower than `max_s` per round (the default schedules': a ResNet-50 runs 5.9 s
    untuned) is timed in one round."""
    per_round = max(1, runs // _PAIRED_ROUNDS)
    round_started = time.perf_counter()

    def slow_round() -> bool:  # the default schedules' model: one round
        nonlocal round_started
        slow, round_started = max_s is not None and time.perf_counter() - round_started > max_s, time.perf_counter()
        return slow

    ratios: dict[int, list[float]] = defaultdict(list)
    for theirs, ours in in_turns(lambda: other.kernel_times(per_round, max_s), lambda: best.kernel_times(per_round),
                                 _PAIRED_ROUNDS, slow_round):
        for key, microseconds in theirs.items():
            if ours.get(key, 0.0) > 0:
                ratios[key].append(microseconds / ours[key])
    return {key: median(values) for key, values in ratios.items()}


class _Comparison:
    """Each rank's kernel times relative to the tuner's best, and the choice they make."""

    def __init__(self, best_us: dict[int, float]) -> None:
        self.best_us = best_us
        self.ratios: dict[int, dict[int, float]] = {0: dict.fromkeys(best_us, 1.0)}
        """By rank (DEFAULT_RANK too): each workload's time in that rank's model / in the tuner's best."""

    def selection(self, ranked: dict[int, list[TuningRecord]], workload_of: dict[str, Workload], seconds: float,
                  stopped: bool, only_best: bool = False) -> Selection:
        """Each kernel's fastest schedule in the model, or with `only_best` the tuner's best of every one."""
        timed = [key for key in ranked if key in self.best_us]  # a workload no kernel ran keeps rank 0
        chosen = dict.fromkeys(ranked, 0) | {key: _fastest(key, len(ranked[key]), self.ratios)
                                             for key in timed if not only_best}

        def in_model_us(key: int) -> float:
            return self.best_us[key] * self.ratios[chosen[key]][key]

        choices = {name: KernelChoice(chosen[_key(w)], in_model_us(_key(w)), self.best_us[_key(w)])
                   for name, w in workload_of.items() if _key(w) in timed}
        return Selection(_pick(ranked, chosen), choices, len(self.ratios), seconds,
                         in_model_us=sum(map(in_model_us, timed)),
                         tuner_best_in_model_us=sum(self.best_us[key] for key in timed),
                         stopped_by_deadline=stopped)


def _scaled_to_target_threads(ratios: dict[int, dict[int, float]], ranked: dict[int, list[TuningRecord]],
                              threads: int, cpu_threads: int) -> None:
    """Each rank's kernel ratios, timed on `threads`, scaled to the target's `cpu_threads` by how the rank's
    schedule and the tuner's best split over each (`thread_share`): on one thread of two a kernel that runs on one
    core reads as fast as one that splits over both, as the tuner's timings did (local_runner.py). The default
    schedules have no record to read: scaled as an even split, as a timing of unknown split is. The whole-model
    check after the choice is not scaled: a choice that wins by its better split alone is not seen winning there,
    and the tuner's best stays."""
    shares = {key: [thread_share(_parallel_extent(record), threads, cpu_threads) for record in records]
              for key, records in ranked.items()}
    for rank, per_key in ratios.items():
        for key in per_key.keys() & shares.keys():
            share = (shares[key][min(rank, len(shares[key]) - 1)] if rank != DEFAULT_RANK
                     else thread_share(None, threads, cpu_threads))
            per_key[key] *= share / shares[key][0]


def _parallel_extent(record: TuningRecord) -> int | None:
    """The parallel extent of a record's schedule (the analyzer's reading of its largest block); None where its
    trace does not replay (the model compiles that kernel unscheduled, `on_skip`)."""
    schedule = Schedule(record.workload.mod)
    try:
        record.trace.apply_to_schedule(schedule, remove_postproc=False)
    except TVM_ERRORS:
        return None
    return parallel_extent(schedule.mod)


def _per_workload(per_kernel: dict[str, float], workload_of: dict[str, Workload]) -> dict[int, float]:
    """Kernel times summed per tuned workload (kernels sharing a schedule, prepacked variants included)."""
    per_workload: dict[int, float] = defaultdict(float)
    for name, microseconds in per_kernel.items():
        workload = workload_of.get(name, workload_of.get(name.removesuffix(_PREPACKED)))
        if workload is not None:
            per_workload[_key(workload)] += microseconds
    return per_workload


def _fastest(key: int, records: int, ratios: dict[int, dict[int, float]]) -> int:
    """The rank of the workload's fastest tuned schedule in the model (by its time relative to the tuner's
    best), or DEFAULT_RANK where its default schedule beat that by more than DEFAULT_MARGIN. Another tuned
    schedule replaces the tuner's best only where it is faster by more than that margin too."""
    tuned = [rank for rank in ratios if 0 <= rank < records]
    best = min(tuned, key=lambda rank: (ratios[rank].get(key, FAILED), rank))
    if ratios[best].get(key, FAILED) > 1 - DEFAULT_MARGIN:
        best = 0
    default = ratios.get(DEFAULT_RANK, {}).get(key, FAILED)
    return DEFAULT_RANK if default < ratios[best].get(key, FAILED) * (1 - DEFAULT_MARGIN) else best


_PLAIN_CALLS = 5
"""Calls of the model without the instrument, after its instrumented runs, that size the later stages' timings."""


@dataclass(frozen=True)
class RankCost:
    """What `select_schedules` spends per rank, measured: one compile of the model, and its timed runs."""

    compile_s: float
    run_s: float
    """Its kernels timed inside it, as the comparison times each rank (instrumented calls)."""
    inference_s: float
    """One call of the model without the kernels' instrument (median): what the later stages time."""

    @property
    def total_s(self) -> float:
        return self.compile_s + self.run_s

    @property
    def compared_s(self) -> float:
        """A model the comparison adds after the tuner's best: its compile, and its kernels timed in turns with
        the best's (both sides' runs). A 5-minute ResNet-18's took 14 s where `total_s` was 11 s."""
        return self.compile_s + 2 * self.run_s

    @property
    def default_s(self) -> float:
        """The default schedules' model, compiled apart (build/untuned.py): only timed in turns with the best, its
        side at most `_DEFAULT_TIMING_SHARE` times as long."""
        return (1 + _DEFAULT_TIMING_SHARE) * self.run_s


def rank_cost(relax_mod: tvm.IRModule, target: tvm.target.Target, database: Database, inputs: list[np.ndarray],
              device: tvm.runtime.Device, winograd: WinogradPolicy | None = None, runs: int = 30,
              before_timing: Callable[[], object] | None = None, compiled_beside: bool = False) -> RankCost:
    """The model compiled with the database's best schedules (as the final compile compiles it: `compile_library`,
    then loaded) and its kernels timed inside it, as `select_schedules` does per rank. A tuning budget keeps this
    much per candidate rank, and the stages after the comparison one compile per model they still have to
    compile. `before_timing` is called between the compile and the timing (and not counted): what ran beside the
    compile ends there. `compiled_beside`: another compile of this build ran beside this one (the untuned model's,
    build/untuned.py), which the later compiles will not have: the compile is counted without the time it waited
    for a core (a MobileNet-V2's took 14.4-14.9 s so against 9.7-10.4 s alone; counted so, 10.9-11.1 s)."""
    from edgetune.machine_load import waited_for_a_core_s

    started, waited_before = time.monotonic(), waited_for_a_core_s()
    workload_of: dict[str, Workload] = {}
    with tempfile.TemporaryDirectory(prefix="edgetune-rank-") as scratch:  # compiled as the final compile is
        library = tvm.runtime.load_module(str(compile_library(relax_mod, target, database, Path(scratch) / "model.so",
                                                              winograd)))
    compile_s = time.monotonic() - started
    if compiled_beside:
        compile_s -= waited_for_a_core_s() - waited_before
    if before_timing is not None:
        before_timing()
    compiled = time.monotonic()
    model = _TimedModel(library, device, [tvm.runtime.tensor(x, device) for x in inputs], workload_of)
    model.kernel_times(runs)
    run_s = time.monotonic() - compiled
    return RankCost(compile_s=compile_s, run_s=run_s, inference_s=model.inference_seconds(_PLAIN_CALLS))


def constant_bytes(relax_mod: tvm.IRModule) -> int:
    """Bytes of the model's constants (its weights), which its exported library carries."""
    sizes: dict[int, int] = {}  # by buffer: a constant used twice is stored once

    def visit(expr) -> None:
        data = getattr(expr, "value", None) if isinstance(expr, tvm.ir.expr.Constant) else None
        if isinstance(data, tvm.runtime.Tensor):  # a relax constant (an IntImm's value is a number)
            sizes[data.data_ptr()] = data.numel() * np.dtype(str(data.dtype)).itemsize

    for function in relax_mod.functions.values():
        if isinstance(function, relax.Function):
            relax.analysis.post_order_visit(function, visit)
    return sum(sizes.values())


def _key(workload: Workload) -> int:
    return tvm_ffi.structural_hash(workload.mod)


def _in_memory(database: Database) -> MemoryDatabase:
    """A copy to query and extend freely: committing a workload to a record store would write to it."""
    copy = MemoryDatabase(module_equality=MODULE_EQUALITY)
    for record in database.get_all_tuning_records():
        commit_record(copy, record)
    return copy


def _usable(records: list[TuningRecord]) -> list[TuningRecord]:
    return [r for r in records if mean_seconds(r.run_secs) < FAILED]


def _pick(ranked: dict[int, list[TuningRecord]], rank_of: dict[int, int]) -> MemoryDatabase:
    """A database holding each workload's record of the given rank (its last where it has fewer); a
    workload at DEFAULT_RANK gets no record, so it compiles with its default schedule."""
    picked = MemoryDatabase(module_equality=MODULE_EQUALITY)
    for key, top in ranked.items():
        if rank_of[key] != DEFAULT_RANK:
            commit_record(picked, top[min(rank_of[key], len(top) - 1)])
    return picked


def _kernel_times(vm: relax.VirtualMachine, arguments: list, runs: int, max_s: float | None = None
                  ) -> dict[str, float]:
    """Median microseconds per inference of each function the model calls, timed inside the model, over
    `runs` inferences or fewer once `max_s` seconds have passed (at least one). The model has run once."""
    samples: dict[str, list[float]] = defaultdict(list)
    started: list[float] = []
    this_run: dict[str, float] = defaultdict(float)

    def instrument(_func, name: str, before_run: bool, _ret, *_args) -> int:
        if before_run:
            started.append(time.perf_counter())
        else:
            this_run[name] += time.perf_counter() - started.pop()
        return VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    timing_started = time.perf_counter()
    for _ in range(runs):
        this_run.clear()
        vm["main"](*arguments)
        for name, seconds in this_run.items():
            samples[name].append(seconds * 1e6)
        if max_s is not None and time.perf_counter() - timing_started > max_s:
            break
    return {name: median(values) for name, values in samples.items()}
