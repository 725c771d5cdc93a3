"""A build on a busy machine against the same build on an idle one: the artifacts timed side by side.

    python benchmarks/busy_machine.py --model resnet18 --budget-min 6 --hogs 1 --seeds 1

For each seed, the zoo model is built twice from scratch (fresh records, the host profile, draft-verify
unless `--search` says otherwise, the given budget): once on the idle machine, once with `--hogs`
CPU-bound processes (busy loops at normal priority) running beside the build. Then, with the machine
idle again, both artifacts and ONNX Runtime are timed interleaved (in a process per way the artifacts' threads
wait, as each ships them: `time_artifacts`), and the table gives
each latency and the ratio busy / idle (1.0: the busy machine cost nothing; the goal is within 1.1): round by
round where one process timed both, else through the ONNX Runtime timed beside each (`ArtifactTimes`).

`--without-remeasure` adds a build per seed, on the busy machine with disturbed timings kept as first
measured (edgetune.tuning.measurements.REMEASURES = 0 in this process, where the builds run): the
re-measurement's own effect, side by side. `--without-fewer-threads` adds one with every candidate timed on
all the target's threads however busy the machine (no share of a core counts as taken: machine_load.py).
`--without-slow-windows` adds one with no candidate timed again for a reference kernel that ran slow beside it
(tuning/slow_windows.py). `--hog-bursts ON OFF` runs the busy loops in bursts, ON seconds busy and OFF seconds
stopped, over and over: a neighbour whose load changes within a batch, which the reading of other programs' CPU
time before each batch (machine_load.py) does not follow.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import build_artifact, recipe_text, time_side_by_side  # noqa: E402  (sets the thread counts first)
from timing import PLACEMENTS, REFERENCE, ArtifactTimes, add_keep_option, build_directory  # noqa: E402

HOG = "while True:\n    pass\n"


@contextmanager
def cpu_hogs(count: int, nice: int | None = None, bursts: tuple[float, float] | None = None):
    """`count` busy-loop processes for the duration of the block (at `nice`, when given; in `bursts` of (busy,
    stopped) seconds, when given), started as another user's programs are: not descendants of this process,
    where the builds run (edgetune counts its own descendants as its workers; the shell that starts each loop
    exits, and init adopts it)."""
    prefix = "" if nice is None else f"nice -n {int(nice)} "
    loop = f"{prefix}{shlex.quote(sys.executable)} -c {shlex.quote(HOG)} >/dev/null 2>&1 & echo $!"
    pids = [int(subprocess.run(["sh", "-c", loop], capture_output=True, text=True, check=True).stdout)
            for _ in range(count)]

    ended = threading.Event()

    def burst() -> None:
        while not ended.wait(bursts[0]):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            ended.wait(bursts[1])
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
    bursting = threading.Thread(target=burst, daemon=True) if bursts is not None else None
    if bursting is not None:
        bursting.start()
    try:
        yield
    finally:
        ended.set()
        if bursting is not None:
            bursting.join()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)


def build(model: str, budget_min: float, search: str, seed: int, hogs: int, output: Path, remeasure: bool,
          fewer_threads: bool, slow_windows: bool = True, hog_bursts: tuple[float, float] | None = None) -> dict:
    from edgetune import machine_load
    from edgetune.tuning import local_runner, measurements

    text = recipe_text(f"busy-{hogs}-{seed}", model, 2, 100_000, budget_min, search, output, 4)
    text = text.replace("  seed: 0\n", f"  seed: {seed}\n")
    remeasures, taken_core, slow_window = measurements.REMEASURES, machine_load.TAKEN_CORE, local_runner.SLOW_WINDOW
    with cpu_hogs(hogs, bursts=hog_bursts):
        started = time.monotonic()
        measurements.REMEASURES = remeasures if remeasure else 0
        machine_load.TAKEN_CORE = taken_core if fewer_threads else float((os.cpu_count() or 1) + 1)  # none taken
        local_runner.SLOW_WINDOW = slow_window if slow_windows else 0.0  # never quiet enough to time again
        try:
            summary = build_artifact(text)
        finally:
            measurements.REMEASURES, machine_load.TAKEN_CORE = remeasures, taken_core
            local_runner.SLOW_WINDOW = slow_window
    summary["wall_s"] = time.monotonic() - started
    return summary


def time_artifacts(model_source: dict, libraries: dict[str, Path], repeats: int) -> ArtifactTimes:
    """Each library and ONNX Runtime timed in turns on the (now idle) machine, each library with its threads
    waiting as its artifact ships them (io.json's `cpu_thread_spin_count`, which its run script sets, and
    `cpu_thread_pool`, edgetune's thread pool, which it starts).
    TVM's pool reads the count once per process, so each way is timed in a process of its own, ONNX Runtime in
    each: an artifact is compared with the ONNX Runtime of its own process (`ArtifactTimes`). Timed in this
    process, every artifact had spun, also those that ship sleeping threads (a ResNet-18's 20.6 ms spinning,
    25.0 ms sleeping as shipped).
    `model_source`: the recipe's `model` mapping the libraries were built from ({"zoo": ...} or {"onnx": ...})."""
    from edgetune.runtime import SPIN_COUNT_ENV

    by_way: dict[tuple[int | None, bool], dict[str, str]] = {}
    for name, path in libraries.items():
        count, pool = shipped_way(path)
        by_way.setdefault((count, pool is not None), {})[name] = str(path)
    times = ArtifactTimes([])
    for (count, pooled), group in by_way.items():
        env = {k: v for k, v in os.environ.items() if k != SPIN_COUNT_ENV}
        if count is not None:
            env[SPIN_COUNT_ENV] = str(count)
        request = json.dumps({"model_source": model_source, "libraries": group, "repeats": repeats})
        child = subprocess.run([sys.executable, __file__, TIME_HERE_FLAG, request], env=env, capture_output=True,
                               text=True, check=False)
        if child.returncode != 0:
            raise SystemExit(f"timing the artifacts failed:\n{child.stdout[-2000:]}{child.stderr[-2000:]}")
        *rounds, last = child.stdout.splitlines()
        print("\n".join(rounds), flush=True)
        times.processes.append(json.loads(last))
        way = ("in edgetune's pool" if pooled else "sleeping" if count == 0 else "spinning" if count is None
               else f"spin count {count}")
        print(f"    timed with their threads {way}: {', '.join(group)}; ONNX Runtime beside them "
              f"{np.median(times.processes[-1][REFERENCE]):.2f} ms", flush=True)
    return times


TIME_HERE_FLAG = "--time-here"
"""The child process `time_artifacts` starts: `busy_machine.py --time-here JSON` times in its own process."""


def shipped_way(library: Path) -> tuple[int | None, Path | None]:
    """How the library's artifact ships its threads waiting: TVM's spin count (None: its default, spinning) and
    edgetune's thread pool (None: TVM's pool runs its loops), from its io.json."""
    from edgetune.package.artifact import IO_NAME

    io_spec = library.parent / IO_NAME
    spec = json.loads(io_spec.read_text()) if io_spec.is_file() else {}
    pool = spec.get("cpu_thread_pool")
    return spec.get("cpu_thread_spin_count"), library.parent / pool if pool else None


def time_here(model_source: dict, libraries: dict[str, Path], repeats: int) -> dict[str, list[float]]:
    """Each library's and ONNX Runtime's median ms per round, the rounds interleaved in this process, and (under
    PLACEMENTS) each round's placement of the CPUs."""
    import tvm

    from edgetune.frontend.onnx import load_model
    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import load_library

    onnx_path = model_source.get("onnx")
    model = load_model(zoo=model_source.get("zoo"), onnx_path=Path(onnx_path) if onnx_path else None,
                       input_shapes=model_source.get("input_shapes"))
    x = model.sample_inputs()[model.inputs[0].name]
    device = tvm.cpu(0)
    tvm_x = tvm.runtime.tensor(x, device)
    machines = {name: load_library(Path(path), device, shipped_way(Path(path))[1], 2)
                for name, path in libraries.items()}
    session = ReferenceRuntime(model)._session(2)
    runners = {name: (lambda vm=vm: vm["main"](tvm_x)) for name, vm in machines.items()}
    runners[REFERENCE] = lambda: session.run(None, {model.inputs[0].name: x})
    times = time_side_by_side(runners, repeats, 1.0)
    return {**{name: t["rounds_ms"] for name, t in times.items()}, PLACEMENTS: times[REFERENCE]["placements"]}


VARIANTS = {"busy-no-remeasure": (False, True, True), "busy-same-threads": (True, False, True),
            "busy-no-windows": (True, True, False)}
"""Busy builds with one defence off: (disturbed timings measured again, timed on the cores left free, timed
again after a slow window)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("resnet18", "mobilenet_v2"), default="resnet18")
    parser.add_argument("--budget-min", type=float, default=6.0)
    parser.add_argument("--search", choices=("evolutionary", "draft-verify"), default="draft-verify")
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes beside the busy build")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--without-remeasure", action="store_true",
                        help="one more build per seed: busy, disturbed timings not measured again")
    parser.add_argument("--without-fewer-threads", action="store_true",
                        help="one more build per seed: busy, every candidate timed on all the target's threads")
    parser.add_argument("--without-slow-windows", action="store_true",
                        help="one more build per seed: busy, no timing taken again after a slow reference reading")
    parser.add_argument("--hog-bursts", type=float, nargs=2, metavar=("ON", "OFF"), default=None,
                        help="run the busy loops ON seconds, stop them OFF seconds, over and over")
    add_keep_option(parser)
    args = parser.parse_args()
    builds = [("idle", 0, True, True, True), ("busy", args.hogs, True, True, True)]
    for label, wanted in (("busy-no-remeasure", args.without_remeasure),
                          ("busy-same-threads", args.without_fewer_threads),
                          ("busy-no-windows", args.without_slow_windows)):
        builds += [(label, args.hogs, *VARIANTS[label])] if wanted else []
    rows = []
    with build_directory(args.keep, "edgetune-busy-") as scratch:
        for seed in args.seeds:
            built = {}
            for label, hogs, remeasure, fewer_threads, slow_windows in builds:
                print(f"seed {seed}: building {args.model}: {label} ({hogs} hogs)", flush=True)
                built[label] = build(args.model, args.budget_min, args.search, seed, hogs,
                                     Path(scratch) / f"{label}-{seed}", remeasure, fewer_threads, slow_windows,
                                     tuple(args.hog_bursts) if args.hog_bursts else None)
            libraries = {k: Path(v["artifact_dir"]) / "model.so" for k, v in built.items()}
            times = time_artifacts({"zoo": args.model}, libraries, args.repeats)
            rows.append((seed, built, times))
    print_table(args, rows)
    return 0


def print_table(args: argparse.Namespace, rows: list) -> None:
    """Per build: its latency, against the idle build's (`ArtifactTimes.relative`) and ONNX Runtime's (beside it)."""
    hogs = f"in bursts ({args.hog_bursts[0]:g} s on, {args.hog_bursts[1]:g} s off)" if args.hog_bursts else "throughout"
    print(f"\n{args.model}, {args.search}, {args.budget_min} min, {args.hogs} hog(s) beside the busy builds {hogs}")
    print("seed  build               ms  /idle  vs ORT  trials  wall s  beat ORT s  disturbed/again/stayed  "
          "fewer threads  slow windows/again/stayed")
    for seed, built, times in rows:
        for label, summary in built.items():
            beat = summary.get("time_to_beat_reference_s")
            print(f"{seed:4d}  {label:17s} {times.ms(label):6.2f} {times.relative(label, 'idle'):6.3f}x "
                  f"{times.vs_reference(label):6.3f}x {summary['trials_measured']:6d} "
                  f"{summary['wall_s']:7.0f}  {'never' if beat is None else f'{beat:.0f}':>10}  "
                  f"{summary['timings_disturbed']}/{summary['timings_remeasured']}/"
                  f"{summary['timings_still_disturbed']:<14} {summary.get('timings_on_fewer_threads', 0):13d}  "
                  f"{summary.get('timings_in_slow_windows', 0)}/{summary.get('timings_retimed_quiet', 0)}/"
                  f"{summary.get('timings_still_slow', 0)}")
        print(f"{seed:4d}  onnxruntime       {times.reference_ms():6.2f}")
    for label in rows[0][1]:
        if label != "idle":
            ratios = [times.relative(label, "idle") for _, _, times in rows]
            print(f"{label} / idle: median {np.median(ratios):.3f}x, range {min(ratios):.3f}-{max(ratios):.3f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == [TIME_HERE_FLAG]:  # a timing process of time_artifacts
        request = json.loads(sys.argv[2])
        print(json.dumps(time_here(request["model_source"], request["libraries"], request["repeats"])))
        sys.exit(0)
    sys.exit(main())
