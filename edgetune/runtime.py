"""Run compiled models with TVM's runtime: load, run, time, and how many CPU threads run them.

The bottom of the package: every stage that runs code (tuning, selection, measuring, verifying) and every
device backend uses these, and this module imports nothing of edgetune's but edgetune's thread pool
(thread_pool.py, as low as it), so none of them reaches up into the compile stage for it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import tvm
from tvm import relax

from edgetune.thread_pool import start_thread_pool

T = TypeVar("T")

_BIG_CORES = 1  # TVM's ThreadGroup affinity mode: threads on the fastest cores, one per core


def use_cpu_threads(cores: int, running: int | None = None) -> None:
    """Run TVM's CPU kernels on `cores` threads, in this process and in workers it starts later; in this
    process, on `running` of them for now (other programs hold the other cores), when given.

    Unless told otherwise, TVM's runtime starts hardware_concurrency / 2 threads on x86, as if every
    core ran two hyper-threads: one thread on a 2-vCPU machine, half of the cores a target is tuned
    for and ONNX Runtime is given. TVM reads the environment variable when a thread's pool starts;
    a pool that ran already can be narrowed, not widened.
    """
    os.environ["TVM_NUM_THREADS"] = str(cores)
    pool_size = tvm.get_global_func("runtime.NumThreads")  # starts this thread's pool if it has not run
    if pool_size() != cores:
        tvm.get_global_func("runtime.config_threadpool")(_BIG_CORES, cores)
    if pool_size() != cores:
        raise RuntimeError(f"TVM's thread pool in this process started with {pool_size()} threads before it was "
                           f"asked for {cores}: set TVM_NUM_THREADS={cores} before running kernels")
    if running is not None and running != cores:  # narrowed after it started on `cores`: it can widen again
        tvm.get_global_func("runtime.config_threadpool")(_BIG_CORES, running)


@contextmanager
def off_the_pool_threads_cores() -> Iterator[None]:
    """This thread kept, while it runs kernels, off the cores TVM's thread pool binds its other threads to.

    The thread that calls a parallel kernel runs the loop's first share itself, and TVM leaves it free to
    run on any core while it binds each pool thread to one. Started on a pool thread's core, it shared that
    core until Linux moved it, 0.1-0.2 s later: the first candidates a fresh tuning worker timed ran at twice
    their time (a convolution measured at 313 us ran at 620-720 us, every time it came first). Linux only;
    elsewhere, where no core is left free, and on a pool narrowed to one thread (its parked threads keep their
    cores, but the calling thread runs every loop alone and is best left where Linux finds a free core), nothing
    changes.
    """
    alone = tvm.get_global_func("runtime.NumThreads")() == 1  # starts this thread's pool, which binds its threads
    try:
        allowed = os.sched_getaffinity(0)
        free = allowed if alone else allowed - _cores_bound_to_other_threads()
    except (AttributeError, OSError):  # no affinity calls or no /proc: not Linux
        allowed = free = set()
    narrowed = bool(free) and free != allowed
    if narrowed:
        os.sched_setaffinity(0, free)
    try:
        yield
    finally:
        if narrowed:
            os.sched_setaffinity(0, allowed)


def _cores_bound_to_other_threads() -> set[int]:
    """The cores this process's other threads are each bound to alone (TVM's pool threads)."""
    own = str(threading.get_native_id())
    bound: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        if task.name == own:
            continue
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cores = line.split(":", 1)[1].strip()
                if cores.isdigit():
                    bound.add(int(cores))
    return bound


def load_library(path: Path, device: tvm.runtime.Device, pool: Path | None = None,
                 pool_threads: int | None = None) -> relax.VirtualMachine:
    """The library's model, ready to run; where `pool` is given, its parallel loops run in edgetune's thread pool
    (thread_pool.py) on `pool_threads` threads (None: as many as TVM's own pool has). TVM never unloads a library
    it loaded: its weights stay in this process until it ends (see `edgetune.isolated`)."""
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), device)
    if pool is not None:
        start_thread_pool(pool, path, pool_threads or tvm.get_global_func("runtime.NumThreads")())
    return vm


def run(vm: relax.VirtualMachine, inputs: list[np.ndarray], device: tvm.runtime.Device) -> list[np.ndarray]:
    result = vm["main"](*[tvm.runtime.tensor(x, device) for x in inputs])
    return _flatten(result)


def _flatten(result) -> list[np.ndarray]:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [array for item in result for array in _flatten(item)]


def time_model(
    vm: relax.VirtualMachine, inputs: list[np.ndarray], device: tvm.runtime.Device, min_total_s: float = 1.0
) -> float:
    """Median latency in milliseconds over _REPEATS repeats, together about `min_total_s` long, or shorter
    for a model so fast that _ENOUGH_CALLS calls take less (never under _SHORTEST_S). A model whose one call
    takes `min_total_s` is timed over single calls, at most _SLOW_REPEATS and about _SLOW_TOTAL_CALLS x
    `min_total_s` in all, and one whose first call takes _FIRST_CALL_ENOUGH times that by its first call. On a
    CPU, the calling thread keeps off the cores of TVM's pool threads while it times (`off_the_pool_threads_cores`).

    Calls per repeat come from three timed calls, not from TVM's `min_repeat_ms`: that grows the count
    by 1.618x steps until a repeat is long enough and keeps the overshoot, so a 0.03 ms model took
    1.75 s to time (50,000 calls) instead of 0.2 s (6,000).
    """
    if device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        with off_the_pool_threads_cores():
            return _time_model(vm, inputs, device, min_total_s)
    return _time_model(vm, inputs, device, min_total_s)


def _time_model(vm: relax.VirtualMachine, inputs: list[np.ndarray], device: tvm.runtime.Device,
                min_total_s: float) -> float:
    args = [tvm.runtime.tensor(x, device) for x in inputs]
    started = time.perf_counter()
    vm["main"](*args)  # warm-up: first call allocates
    repeats = _REPEATS
    first_call_s = time.perf_counter() - started
    if first_call_s >= _FIRST_CALL_ENOUGH * min_total_s:  # what the first call allocates is lost in its length
        return first_call_s * 1e3
    if first_call_s >= min_total_s:  # 5 calls of an untuned ResNet-50 took 30 s of a build's 6-minute budget
        number, repeats = 1, _slow_repeats(first_call_s, min_total_s)
    else:
        per_call_s = max(float(vm.time_evaluator("main", device, number=1, repeat=_SIZING_CALLS)(*args).median), 1e-7)
        number = _calls_per_repeat(per_call_s, min_total_s)
    timer = vm.time_evaluator("main", device, number=number, repeat=repeats)
    return float(timer(*args).median) * 1e3


def timed_seconds(per_call_s: float, min_total_s: float = 1.0) -> float:
    """How long `time_model` runs a model whose call takes `per_call_s` (below a second a call): `min_total_s`,
    or _ENOUGH_CALLS calls of a faster model, never under _SHORTEST_S."""
    return min(min_total_s, max(_SHORTEST_S, _ENOUGH_CALLS * per_call_s))


def time_model_seconds(per_call_s: float, min_total_s: float = 1.0) -> float:
    """How long `time_model` takes, all its calls counted, for a model whose call takes `per_call_s`: what a
    time budget keeps for one timing. TVM's time evaluator adds an untimed call before its repeats."""
    if per_call_s >= _FIRST_CALL_ENOUGH * min_total_s:
        return per_call_s
    if per_call_s >= min_total_s:
        return per_call_s * (1 + 1 + _slow_repeats(per_call_s, min_total_s))
    calls = 1 + (1 + _SIZING_CALLS) + (1 + _REPEATS * _calls_per_repeat(per_call_s, min_total_s))
    return per_call_s * calls


def _slow_repeats(call_s: float, min_total_s: float) -> int:
    """Single calls timed of a model whose one call takes `min_total_s` or more."""
    return max(1, min(_SLOW_REPEATS, round(_SLOW_TOTAL_CALLS * min_total_s / call_s)))


def _calls_per_repeat(call_s: float, min_total_s: float) -> int:
    return max(1, math.ceil(timed_seconds(call_s, min_total_s) / _REPEATS / call_s))


_REPEATS = 5
_FIRST_CALL_ENOUGH = 10
"""A model whose first call takes this many times a timing's length is timed by that call alone (its warm-up
allocates the model's memory: milliseconds of a call this long). An untuned ResNet-50, 7.6 s a call, was timed over
three calls (the warm-up, the time evaluator's own untimed call, one timed): 23 s of a 10-minute build."""
UNTUNED_TIMING_S = 0.2
"""How long the untuned model is timed (`min_total_s`): its latency is the manifest's figure beside the tuned one,
and a second's timing of it (an untuned GoogLeNet's 0.8-s calls: eleven of them) came out of the tuning's budget."""
_SIZING_CALLS = 3
"""Timed calls that size a repeat."""
_SLOW_REPEATS = 3
_SLOW_TOTAL_CALLS = 3
_ENOUGH_CALLS = 1000
_SHORTEST_S = 0.2
FULL_TIMING_CALL_S = 1.0 / _ENOUGH_CALLS
"""The shortest call whose `time_model` (a second) runs its full length, not a thousand calls' shorter one."""


RELEASE_ABOVE_BYTES = 1 << 30
"""Resident size above which a stage's end hands freed memory back (a tiny build: 0.55 GB, TVM's libraries most
of it; a ResNet-50's: several GB)."""


def release_freed_memory() -> None:
    """Hand memory a stage freed back to the system: glibc keeps freed heap for reuse, so a build's resident
    size only ever grew (a ResNet-50's weights are copied by import, compile, export and each run), and the
    next stage's peak came on top of the last one's leftovers. A process under RELEASE_ABOVE_BYTES keeps its heap:
    a full collection took 0.17-0.20 s at each of a tiny build's stages, for nothing worth handing back."""
    import ctypes
    import gc

    import psutil

    if psutil.Process().memory_info().rss < RELEASE_ABOVE_BYTES:
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


TIMING_ROUNDS = 3
"""Rounds in which the build times the tuned model and the reference in turns (build/measure.py)."""

SPIN_COUNT_ENV = "TVM_THREAD_POOL_SPIN_COUNT"
"""TVM's runtime reads it once, when a process's thread pool starts: how many times a thread waiting for work
(a worker between two parallel loops) yields its core before it sleeps; 300,000 when unset. A parallel loop is
one static share per thread and waits for the last share, so beside another busy process every yield can hand
that process the core for a time slice: timed beside one busy loop at nice 19, a ResNet-18 artifact ran at
20-30 ms spinning and 12-16 ms with 0 (ONNX Runtime 17.6 ms); beside one at normal priority, 21 or 140 ms
spinning against 22-24 ms (benchmarks/contention.py)."""

SPIN_DOWN_S = 0.15
"""A spinning pool's threads go on yielding for up to 300,000 turns after their last loop (0.05-0.1 s on an idle
core, at 0.15-0.3 us a yield): a timing in another process starts this long after."""

SLEEPING_COST_ACCEPTED = 1.05
"""A way of waiting whose model is at most this much slower than the fastest way's, idle and beside a busy
process, counts as no slower (`thread_wait_policy`): sleeping costs a wake-up per parallel loop, a few percent of
a ResNet-18 and up to a quarter of a MobileNet-V2 (many short kernels)."""

ThreadWait = Literal["spin", "sleep", "pool"]
"""How an artifact's CPU threads wait for work: TVM's pool spinning (yielding the core), TVM's pool sleeping
(spin count 0), or edgetune's pool (thread_pool.py: a short spin that keeps the core, then sleep)."""

_PREFERRED: tuple[ThreadWait, ...] = ("pool", "sleep", "spin")
"""Between ways that cost the same, the first. Edgetune's pool sleeps after a 50-us spin and was nowhere slower than
TVM's sleeping threads when timed over rounds (a ResNet-18 on a Zen 3 VM, 5 rounds: 16.08 against 17.56 ms idle,
18.18 against 30.32 beside a nice-19 loop); a build's few timings put the two within 5% of each other, and two of
three 10-minute builds had shipped the sleeping threads. Of TVM's two ways, sleeping leaves other programs the most."""


def thread_wait_policy(idle_ms: dict[ThreadWait, float], busy_ms: dict[ThreadWait, float] | None = None
                       ) -> ThreadWait:
    """How an artifact's CPU threads wait for work, from the model's latency timed each way on an idle machine
    and, where every way was timed so, beside a low-priority busy process: the way whose loss against the fastest
    way, idle or busy (the larger), is the smallest; a loss up to SLEEPING_COST_ACCEPTED counts as none, and
    ties go by _PREFERRED (edgetune's pool, then sleeping). A ResNet-18 artifact that slept 5-21% slower idle
    (AVX2 VM, 4 sets of 3 rounds) ran 1.59-1.67x slower spinning beside one nice-19 loop, 3.9-4.5x beside one at
    normal priority; edgetune's pool ran a MobileNet-V2 as fast as spinning idle and as sleeping beside the loop."""
    busy = busy_ms if busy_ms and set(busy_ms) == set(idle_ms) else {}

    def loss(way: ThreadWait) -> float:
        losses = [idle_ms[way] / min(idle_ms.values())]
        if busy:
            losses.append(busy[way] / min(busy.values()))
        return max(SLEEPING_COST_ACCEPTED, *losses)

    return min((way for way in _PREFERRED if way in idle_ms), key=loss)


def thread_wait_ways(wanted: ThreadWait | Literal["auto"], pool: bool = False) -> tuple[ThreadWait, ...]:
    """The ways the tuned model is timed in for the recipe's `package.thread_wait`: both ways where the build
    chooses ("auto"), else the one asked for. Where edgetune's pool is built for the target (`pool`), it stands for
    spinning: as fast idle (a MobileNet-V2 6.76 against 6.95 ms, a ResNet-18 20.40 against 20.26 ms, 2-core Zen 3
    VM) and not slowed beside a busy process (9.0 against 24.0 ms beside a nice-19 loop; sleeping 10.3 ms)."""
    if wanted != "auto":
        return (wanted,)
    return ("pool", "sleep") if pool else ("spin", "sleep")


def spin_count(policy: ThreadWait | None) -> int | None:
    """The `SPIN_COUNT_ENV` value that gives `policy` (None: TVM's default, which spins). With edgetune's pool
    TVM's own pool runs no kernel; its threads sleep."""
    return None if policy in (None, "spin") else 0


def in_turns(first: Callable[[], T], second: Callable[[], T], rounds: int,
             enough: Callable[[], bool] | None = None) -> list[tuple[T, T]]:
    """`rounds` pairs of what `first` and `second` return, taken in turns (`each_in_turns`); `enough()`,
    asked after each round, ends the rounds early."""
    results = each_in_turns({"first": first, "second": second}, rounds, enough)
    return list(zip(results["first"], results["second"]))


def each_in_turns(sides: dict[str, Callable[[], T]], rounds: int,
                  enough: Callable[[], bool] | None = None) -> dict[str, list[T]]:
    """Each side's result `rounds` times, taking turns (in the given order in even rounds, reversed in odd ones):
    this machine's speed drifts for seconds at a time, and so a slow spell meets all sides of a round, or one
    round of each, which a median over rounds leaves out. `enough()`, asked after each round, ends them early."""
    results: dict[str, list[T]] = {name: [] for name in sides}
    for index in range(rounds):
        for name in (list(sides) if index % 2 == 0 else list(reversed(sides))):
            results[name].append(sides[name]())
        if enough is not None and enough():
            break
    return results
