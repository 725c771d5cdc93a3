"""What building and timing a candidate costs on this machine, with the tuning's own builder and runner.

    python benchmarks/candidate_pipeline.py build/host-resnet18/records/host-* --candidates 320 --rounds 2

The same candidates (the first `--candidates` that a build for this machine measured, from its record store)
go through edgetune's CandidateBuilder and LocalCandidateRunner on one pool of workers, in batches of 16 as
draft-verify sends them, once per variant and round, the variants in turns:
- `tar-64`: TVM's default `.tar` export (the runner links each candidate as it loads it), workers replaced
  every 64 jobs (edgetune before 2026-11-27);
- `so-64`: linked into a shared object by the builder's workers (by `g++ -shared`), the runner only loads it;
- `so-256`: that, with workers replaced every 256 jobs (edgetune before 2026-12-06);
- `ld-256`: that, linked by `ld` without the compiler driver (edgetune's default: `link_for_this_machine`).
`--variants` picks some (the first is the base of the ratios).
Prints each variant's seconds per round, the workers' peak resident size, and the time against `tar-64`'s.
The main process's schedule replays are not timed: each variant gets the same scheduled modules.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: F401  (sets the thread counts first)

VARIANTS = {"tar-64": (False, 64, None), "so-64": (True, 64, "g++"), "so-256": (True, 256, "g++"),
            "ld-256": (True, 256, None)}
"""(linked by the builder, jobs per worker, the builder's linker: a compiler command, None for edgetune's own)"""
BATCH = 16


def replayed_records(store: Path, wanted: Callable[[int], bool] = lambda task: True) -> Iterator[tuple[int, object]]:
    """(its task's workload hash, its schedule's module) of each candidate a build measured, in the order measured,
    scheduled again from its trace: what the tuning builds and times, not random schedules (those build and run
    several times slower). A candidate whose task `wanted` refuses, when it comes, is not replayed."""
    import tvm_ffi
    from tvm.s_tir import Schedule
    from tvm.s_tir import meta_schedule as ms

    database = ms.database.JSONDatabase(str(store / "database_workload.json"),
                                        str(store / "database_tuning_record.json"), allow_missing=False)
    for record in database.get_all_tuning_records():
        task = tvm_ffi.structural_hash(record.workload.mod)
        if not wanted(task):
            continue
        schedule = Schedule(record.workload.mod)
        record.trace.apply_to_schedule(schedule, remove_postproc=False)
        yield task, schedule.mod


def first_of_each_task(store: Path, per_task: int) -> list[tuple[int, object]]:
    """The first `per_task` candidates the store's build measured of each task (`replayed_records`): a first
    batch's drafts, or a sample of every task's early candidates."""
    taken: collections.Counter = collections.Counter()

    def wanted(task: int) -> bool:
        taken[task] += 1
        return taken[task] <= per_task

    return list(replayed_records(store, wanted))


def measured_modules(store: Path, count: int) -> tuple[list, object]:
    """The first `count` candidates a build measured (`replayed_records`), and this machine's target."""
    from edgetune.profiles import resolve_profile

    modules = [module for _, module in itertools.islice(replayed_records(store), count)]
    return modules, resolve_profile("host", None).tvm_target()


def peak_rss_mb(pool) -> int:
    """The largest resident size among the pool's live workers (psutil, as benchmarks/memory.py reads it)."""
    import psutil

    sizes = []
    for worker in pool._worker_map.values():
        if worker._proc is None:
            continue
        try:
            sizes.append(psutil.Process(worker._proc.pid).memory_info().rss // 2**20)
        except psutil.Error:  # ended between the listing and the reading
            continue
    return max(sizes, default=0)


def run_variant(modules: list, target, links_in_builder: bool, uses: int, linker: str | None
                ) -> tuple[float, int, int]:
    """(seconds, the workers' peak RSS in MB, failures) for every module built and timed in batches."""
    import shutil
    from os.path import dirname

    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    from edgetune.runtime import use_cpu_threads
    from edgetune.tuning.builder import CandidateBuilder, linking_builder
    from edgetune.tuning.local_runner import LocalCandidateRunner
    from edgetune.tuning.tune import timing
    from edgetune.tuning.worker_pool import WorkerPool

    use_cpu_threads(2)
    workers = WorkerPool(2, timeout=None, uses_per_worker=uses)
    builder = linking_builder(2, linker, pool=workers) if links_in_builder else CandidateBuilder(2, pool=workers)
    runner = LocalCandidateRunner(timing("cpu"), pool=workers, cpu_threads=2)
    started, peak, failed = time.perf_counter(), 0, 0
    try:
        for first in range(0, len(modules), BATCH):
            batch = modules[first:first + BATCH]
            built = builder.build([BuilderInput(mod, target) for mod in batch])
            inputs = [RunnerInput(b.artifact_path, "cpu", ArgInfo.from_entry_func(mod, remove_preproc=True))
                      for b, mod in zip(built, batch) if b.error_msg is None]
            results = [future.result() for future in runner.run(inputs)]
            failed += sum(b.error_msg is not None for b in built) + sum(r.error_msg is not None for r in results)
            peak = max(peak, peak_rss_mb(workers))
            for each in inputs:  # as the tuning loop does once a batch is recorded
                shutil.rmtree(dirname(str(each.artifact_path)), ignore_errors=True)
        return time.perf_counter() - started, peak, failed
    finally:
        builder.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path, help="a target's record store of a build for this machine")
    parser.add_argument("--candidates", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    modules, target = measured_modules(args.store, args.candidates)
    print(f"{len(modules)} candidates measured in {args.store}, batches of {BATCH}", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in args.variants}
    peaks: dict[str, int] = dict.fromkeys(args.variants, 0)
    for round_index in range(args.rounds):
        for name in args.variants:
            wall, peak, failed = run_variant(modules, target, *VARIANTS[name])
            seconds[name].append(wall)
            peaks[name] = max(peaks[name], peak)
            print(f"  round {round_index + 1}: {name} {wall:.1f} s (peak {peak} MB, {failed} failed)", flush=True)
    base = statistics.median(seconds[args.variants[0]])
    print(f"{'variant':10s} {'median s':>9s} {'spread s':>13s} {'peak MB':>8s} {'vs ' + args.variants[0]:>10s}")
    for name, walls in seconds.items():
        median = statistics.median(walls)
        print(f"{name:10s} {median:9.1f} {min(walls):6.1f}-{max(walls):<6.1f} {peaks[name]:8d} {median / base:9.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
