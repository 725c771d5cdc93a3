"""The first batch's drafting: every task's first drafts made in the main process, or on the tuning's workers.

    python benchmarks/first_drafts.py --model mobilenet_v2 --rounds 3
    python benchmarks/first_drafts.py --onnx googlenet.onnx --rounds 2

Extracts the model's tasks for this machine (host profile, its cores) as a build does, then drafts every task's
FIRST_DRAFTS (what a build from scratch measures first) through the tuning's own `_first_drafts`: once with no
pool (each task drafted in this process, edgetune before 2026-11-27) and once on a pool of the profile's cores
(one job per task, the traces replayed here), the two taking turns for `--rounds` rounds. The pool is started
and warmed (TVM imported, the target's intrinsics registered) before the first round, as a build's pool is when
its first batch starts. Prints each round's seconds, the medians and their ratio, and whether both ways drafted
the same programs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: F401  (sets the thread counts first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v2", choices=["resnet18", "mobilenet_v2"])
    parser.add_argument("--onnx", type=Path, default=None, help="an ONNX file instead of the zoo model")
    parser.add_argument("--input-shapes", type=json.loads, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import tvm_ffi

    from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
    from edgetune.frontend.winograd import WinogradPolicy
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.intrinsics import register_tensor_intrinsics
    from edgetune.tuning.search_strategy.draft_verify import SearchCounts
    from edgetune.tuning.task_scheduler import TaskOutcome
    from edgetune.tuning.tasks import extract_tasks
    from edgetune.tuning.tune import UNBOUNDED_TRIALS, TuningPlan, TuningResult, _first_drafts, drafted_traces
    from edgetune.tuning.worker_pool import WorkerPool

    profile = resolve_profile("host", None)
    target, hardware = profile.tvm_target(), profile.hardware
    model = load_model(zoo=None if args.onnx else args.model, onnx_path=args.onnx, input_shapes=args.input_shapes)
    winograd = WinogradPolicy(hardware.peak_gflops, hardware.memory_bandwidth_gbs)
    tasks = extract_tasks(fuse_for_tuning(to_relax(model), target, winograd), target)
    register_tensor_intrinsics(target)
    cores = hardware.cores or 1
    plan = TuningPlan(UNBOUNDED_TRIALS, None, "draft-verify", 0, cores, hardware, profile.device, profile.isa)
    print(f"{len(tasks)} tasks, {cores} workers", flush=True)

    def drafted(pool) -> tuple[float, list]:
        result = TuningResult(tasks=[TaskOutcome(t.name, t.weight, t.flops, 0, 0, None) for t in tasks])
        started = time.monotonic()
        drafts = _first_drafts(tasks, result, target, plan, pool)(list(range(len(tasks))))
        seconds = time.monotonic() - started
        return seconds, [(p, [tvm_ffi.structural_hash(c.sch.mod) for c in cs]) for p, _, cs in drafts]

    pool = WorkerPool(cores, None)
    try:  # warmed as a build's pool is by then: TVM imported, the intrinsics registered
        for job in [pool.submit_with_timeout(None, drafted_traces, tasks[0], 1, target, plan, 1, SearchCounts())
                    for _ in range(cores)]:
            job.result()
        times: dict[str, list[float]] = {"in process": [], "on workers": []}
        programs = {}
        for index in range(args.rounds):
            ways = [("in process", None), ("on workers", pool)]
            for name, way in ways if index % 2 == 0 else reversed(ways):
                seconds, programs[name] = drafted(way)
                times[name].append(seconds)
                print(f"round {index + 1}: {name}: {seconds:.1f} s", flush=True)
    finally:
        pool.shutdown()
    here, there = (statistics.median(times[name]) for name in times)
    print(f"median: in process {here:.1f} s, on {cores} workers {there:.1f} s ({here / there:.2f}x); "
          f"the same programs: {programs['in process'] == programs['on workers']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
