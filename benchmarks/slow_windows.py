"""A first batch timed while other programs burst onto every core: what the reference kernel's windows save.

    python benchmarks/slow_windows.py build/host-resnet18/records/host-* --rounds 5

The first two candidates of each task a build for this machine measured (its first batch's drafts) are
built once, then timed as the tuning's first batch times them (LocalCandidateRunner.time_results, a fresh
runner each time), in rounds, three variants in turns:
- `idle`: nothing else runs;
- `burst`: busy loops at this process's priority, one per core, run while `--burst` consecutive candidates
  are timed, starting at a random candidate: after the batch read how busy the machine was (machine_load.py),
  so the batch is timed on every thread;
- `burst-no-windows`: the same burst, with no candidate timed again after a slow reference reading.
For each variant it prints the sum over tasks of each task's best time in the batch (the tuning curve's first
point, before the rest of the model is added), that sum against the same round's idle one, and how many
candidates came out more than twice their idle time.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: F401  (sets the thread counts first)
from busy_machine import HOG
from candidate_pipeline import first_of_each_task

VARIANTS = ("idle", "burst", "burst-no-windows")


def first_batch(store: Path, per_task: int) -> tuple[list, list[int], object]:
    """The first `per_task` candidates the store's build measured of each task (its first batch's drafts, scheduled
    again from their traces), each one's task (by workload), and the target."""
    from edgetune.profiles import resolve_profile

    records = first_of_each_task(store, per_task)
    return [module for _, module in records], [task for task, _ in records], resolve_profile("host", None).tvm_target()


def stopped_hogs(count: int) -> list[int]:
    """`count` busy loops, started and stopped at once (SIGSTOP), so a burst starts without an interpreter's start."""
    pids = [subprocess.Popen([sys.executable, "-c", HOG]).pid for _ in range(count)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def time_batch(pool, inputs: list, tasks: list[int], hogs: list[int], burst: range | None,
               windows: bool) -> list[float]:
    """Each input's mean seconds as a fresh runner's first batch times them (each counted into its own task, as
    tuning/first_batch.py counts them), the hogs running over `burst`."""
    from edgetune.tuning import local_runner
    from edgetune.tuning.measurements import NoiseCounts, mean_seconds
    from edgetune.tuning.tune import timing

    runner = local_runner.LocalCandidateRunner(timing("cpu"), pool=pool, cpu_threads=2)
    slow_window = local_runner.SLOW_WINDOW
    counts = {task: NoiseCounts() for task in tasks}

    def before_each(i: int) -> None:
        runner.noise.watch(counts[tasks[i]], None)
        if burst is not None and i in (burst.start, burst.stop):
            for pid in hogs:
                os.kill(pid, signal.SIGCONT if i == burst.start else signal.SIGSTOP)
    local_runner.SLOW_WINDOW = slow_window if windows else 0.0  # never quiet enough to time again
    try:
        results = runner.time_results(inputs, before_each=before_each)
    finally:
        local_runner.SLOW_WINDOW = slow_window
        for pid in hogs:
            os.kill(pid, signal.SIGSTOP)
        if runner._reference_dir is not None:
            shutil.rmtree(runner._reference_dir, ignore_errors=True)
    return [mean_seconds(r.run_secs) if r.error_msg is None else float("inf") for r in results]


def task_sum(means: list[float], tasks: list[int]) -> float:
    """The sum over tasks of each task's best mean (ms)."""
    best: dict[int, float] = {}
    for mean, task in zip(means, tasks):
        best[task] = min(best.get(task, float("inf")), mean)
    return 1e3 * sum(best.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path, help="a target's record store of a build for this machine")
    parser.add_argument("--per-task", type=int, default=2, help="first candidates of each task (draft-verify's 2)")
    parser.add_argument("--burst", type=int, default=6, help="consecutive candidates timed during a burst")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    from edgetune.runtime import use_cpu_threads
    from edgetune.tuning.builder import linking_builder
    from edgetune.tuning.worker_pool import WorkerPool

    modules, tasks, target = first_batch(args.store, args.per_task)
    use_cpu_threads(2)
    pool = WorkerPool(2, timeout=None)
    builder = linking_builder(2, None, pool=pool)
    built = builder.build([BuilderInput(mod, target) for mod in modules])
    kept = [i for i, b in enumerate(built) if b.error_msg is None]
    inputs = [RunnerInput(built[i].artifact_path, "cpu", ArgInfo.from_entry_func(modules[i], remove_preproc=True))
              for i in kept]
    tasks = [tasks[i] for i in kept]
    print(f"{len(inputs)} candidates of {len(set(tasks))} tasks from {args.store}; bursts over {args.burst}", flush=True)
    hogs = stopped_hogs(os.cpu_count() or 1)
    sums: dict[str, list[float]] = {name: [] for name in VARIANTS}
    doubled: dict[str, list[int]] = {name: [] for name in VARIANTS}
    try:
        for round_index in range(args.rounds):
            start = random.Random(round_index).randrange(0, max(1, len(inputs) - args.burst))
            burst = range(start, start + args.burst)
            means = {name: time_batch(pool, inputs, tasks, hogs, None if name == "idle" else burst,
                                      windows=name != "burst-no-windows") for name in VARIANTS}
            for name in VARIANTS:
                sums[name].append(task_sum(means[name], tasks))
                doubled[name].append(sum(m > 2 * i for m, i in zip(means[name], means["idle"])))
            print(f"  round {round_index + 1} (burst over candidates {start}-{burst.stop - 1}): " + ", ".join(
                f"{name} {sums[name][-1]:.3f} ms ({doubled[name][-1]} doubled)" for name in VARIANTS), flush=True)
    finally:
        for pid in hogs:
            os.kill(pid, signal.SIGKILL)
        for i in kept:
            shutil.rmtree(os.path.dirname(built[i].artifact_path), ignore_errors=True)
        builder.close()
    print(f"{'variant':17s} {'tasks summed, ms':>17s} {'vs idle (median, range)':>24s} {'doubled':>8s}")
    for name in VARIANTS:
        ratios = [s / i for s, i in zip(sums[name], sums["idle"])]
        print(f"{name:17s} {statistics.median(sums[name]):17.3f} {statistics.median(ratios):10.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f}) {statistics.median(doubled[name]):8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
