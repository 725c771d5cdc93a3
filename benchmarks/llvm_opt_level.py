"""What LLVM's optimization level costs in building a candidate and gives in running it, on this machine.

    python benchmarks/llvm_opt_level.py build/host-resnet18/records/host-* --per-task 6 --rounds 3

The first `--per-task` candidates of each task that a build measured (its record store, replayed from their
traces) are built for this machine's target at each `--opt-levels` (the target's `opt-level`: LLVM's pass
pipeline and code generation level; 3 when the target does not set it) and linked as the tuning links them.
Then every candidate is timed at every level in this one process, the levels in turns, `--rounds` times (the
tuning's timing, on the target's threads). Printed per task: build seconds (lowering, code generation and
link) at each level, and the run time of each level against the first; then the totals and the spread.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: F401  (sets the thread counts first)
from candidate_pipeline import first_of_each_task


def build_at_levels(modules: list[tuple[int, object]], levels: list[int], directory: Path
                    ) -> dict[tuple[int, int], tuple[str, float]]:
    """(candidate position, level) -> (the linked library, seconds to build and link it)."""
    import tvm

    from edgetune.profiles import resolve_profile
    from edgetune.tuning.builder import build_candidate

    base = dict(resolve_profile("host", None).tvm_target().export())
    built = {}
    for position, (_, module) in enumerate(modules):
        for level in levels:
            target = tvm.target.Target({**base, "opt-level": level})
            path = str(directory / f"{position}-O{level}.so")
            started = time.perf_counter()
            build_candidate(module, target, None).export_library(path)
            built[position, level] = (path, time.perf_counter() - started)
    return built


def time_all(modules: list[tuple[int, object]], levels: list[int], built: dict, rounds: int
             ) -> dict[tuple[int, int], float]:
    """(candidate position, level) -> the median over rounds of its mean run time, levels timed in turns."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from edgetune.tuning.local_runner import time_candidate
    from edgetune.tuning.tune import timing

    config = timing("cpu")
    means: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    arguments = [tuple(info.as_json() for info in ArgInfo.from_entry_func(module, remove_preproc=True))
                 for _, module in modules]
    for turn in range(rounds):
        for position in range(len(modules)):
            order = levels if (turn + position) % 2 == 0 else levels[::-1]
            for level in order:
                seconds = time_candidate(config, built[position, level][0], "cpu", arguments[position], 2, 2)
                means[position, level].append(statistics.fmean(seconds))
    return {key: statistics.median(values) for key, values in means.items()}


def report(modules: list[tuple[int, object]], levels: list[int], built: dict, times: dict) -> None:
    first = levels[0]
    by_task: dict[int, list[int]] = collections.defaultdict(list)
    for position, (task, _) in enumerate(modules):
        by_task[task].append(position)
    header = "task                  n" + "".join(f"  build s O{lv}" for lv in levels) + "".join(
        f"  run O{lv}/O{first} (min-max)" for lv in levels[1:])
    print(header)
    for task, positions in by_task.items():
        builds = "".join(f"  {sum(built[p, lv][1] for p in positions):10.2f}" for lv in levels)
        ratios = ""
        for level in levels[1:]:
            each = [times[p, level] / times[p, first] for p in positions]
            ratios += f"  {statistics.median(each):6.3f} ({min(each):.3f}-{max(each):.3f})"
        print(f"{task:<20d} {len(positions):2d}{builds}{ratios}")
    for level in levels[1:]:
        each = [times[p, level] / times[p, first] for p in range(len(modules))]
        geomean = statistics.geometric_mean(each)
        print(f"O{level} against O{first}: build {sum(built[p, level][1] for p in range(len(modules))):.1f} s against "
              f"{sum(built[p, first][1] for p in range(len(modules))):.1f} s; run time geometric mean {geomean:.3f}, "
              f"median {statistics.median(each):.3f}, range {min(each):.3f}-{max(each):.3f}, "
              f"{sum(r > 1.05 for r in each)} of {len(each)} over 1.05")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="a build's record store (records/<target>-<digest>)")
    parser.add_argument("--per-task", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--opt-levels", type=int, nargs="+", default=[3, 2])
    args = parser.parse_args()
    modules = first_of_each_task(args.store, args.per_task)
    print(f"{len(modules)} candidates of {len({task for task, _ in modules})} tasks", flush=True)
    with tempfile.TemporaryDirectory(prefix="llvm-opt-level-") as directory:
        built = build_at_levels(modules, args.opt_levels, Path(directory))
        report(modules, args.opt_levels, built, time_all(modules, args.opt_levels, built, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
