"""A build on a busy machine against the same build on an idle one: the artifacts timed side by side.

    python benchmarks/busy_machine.py --model resnet18 --budget-min 6 --hogs 1 --seeds 1

For each seed, the zoo model is built twice from scratch (fresh records, the host profile, draft-verify
unless `--search` says otherwise, the given budget): once on the idle machine, once with `--hogs`
CPU-bound processes (busy loops at normal priority) running beside the build. Then, with the machine
idle again, both artifacts and ONNX Runtime are timed interleaved in one process, and the table gives
each latency and the ratio busy / idle (1.0: the busy machine cost nothing; the goal is within 1.1).

`--without-remeasure` adds a third build per seed, on the busy machine with disturbed timings kept as
first measured (edgetune.tuning.measurements.REMEASURES = 0 in this process, where the builds run): the
re-measurement's own effect, side by side.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import build_artifact, recipe_text, time_side_by_side  # noqa: E402  (sets the thread counts first)
from timing import add_keep_option, build_directory  # noqa: E402

HOG = "while True:\n    pass\n"


@contextmanager
def cpu_hogs(count: int, nice: int | None = None):
    """`count` busy-loop processes for the duration of the block (at `nice`, when given)."""
    prefix = [] if nice is None else ["nice", "-n", str(nice)]
    hogs = [subprocess.Popen([*prefix, sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def build(model: str, budget_min: float, search: str, seed: int, hogs: int, output: Path, remeasure: bool) -> dict:
    from edgetune.tuning import measurements

    text = recipe_text(f"busy-{hogs}-{seed}", model, 2, 100_000, budget_min, search, output, 4)
    text = text.replace("  seed: 0\n", f"  seed: {seed}\n")
    remeasures = measurements.REMEASURES
    with cpu_hogs(hogs):
        started = time.monotonic()
        measurements.REMEASURES = remeasures if remeasure else 0
        try:
            summary = build_artifact(text)
        finally:
            measurements.REMEASURES = remeasures
    summary["wall_s"] = time.monotonic() - started
    return summary


def time_artifacts(model_source: dict, libraries: dict[str, Path], repeats: int) -> dict[str, float]:
    """Median ms of each library and of ONNX Runtime, interleaved on the (now idle) machine.
    `model_source`: the recipe's `model` mapping the libraries were built from ({"zoo": ...} or {"onnx": ...})."""
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
    machines = {name: load_library(path, device) for name, path in libraries.items()}
    session = ReferenceRuntime(model)._session(2)
    runners = {name: (lambda vm=vm: vm["main"](tvm_x)) for name, vm in machines.items()}
    runners["onnxruntime"] = lambda: session.run(None, {model.inputs[0].name: x})
    return {name: t["median_ms"] for name, t in time_side_by_side(runners, repeats, 1.0).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("resnet18", "mobilenet_v2"), default="resnet18")
    parser.add_argument("--budget-min", type=float, default=6.0)
    parser.add_argument("--search", choices=("evolutionary", "draft-verify"), default="draft-verify")
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes beside the busy build")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--without-remeasure", action="store_true",
                        help="a third build per seed: busy, disturbed timings not measured again")
    add_keep_option(parser)
    args = parser.parse_args()
    builds = [("idle", 0, True), ("busy", args.hogs, True)]
    builds += [("busy-no-remeasure", args.hogs, False)] if args.without_remeasure else []
    rows = []
    with build_directory(args.keep, "edgetune-busy-") as scratch:
        for seed in args.seeds:
            built = {}
            for label, hogs, remeasure in builds:
                print(f"seed {seed}: building {args.model}: {label} ({hogs} hogs)", flush=True)
                built[label] = build(args.model, args.budget_min, args.search, seed, hogs,
                                     Path(scratch) / f"{label}-{seed}", remeasure)
            libraries = {k: Path(v["artifact_dir"]) / "model.so" for k, v in built.items()}
            times = time_artifacts({"zoo": args.model}, libraries, args.repeats)
            rows.append((seed, built, times))
    print(f"\n{args.model}, {args.search}, {args.budget_min} min, {args.hogs} hog(s) beside the busy build")
    print("seed  idle ms  busy ms  ORT ms  busy/idle  idle vs ORT  busy vs ORT  trials idle/busy  wall idle/busy"
          "  timings disturbed/measured again/stayed so, idle; busy")
    for seed, built, times in rows:
        idle, busy, ort = times["idle"], times["busy"], times["onnxruntime"]
        print(f"{seed:4d} {idle:8.2f} {busy:8.2f} {ort:7.2f} {busy / idle:9.3f}x {ort / idle:10.3f}x "
              f"{ort / busy:10.3f}x {built['idle']['trials_measured']:8d}/{built['busy']['trials_measured']:<6d}"
              f" {built['idle']['wall_s']:6.0f}/{built['busy']['wall_s']:.0f} s"
              + "  " + "; ".join(f"{built[k]['timings_disturbed']}/{built[k]['timings_remeasured']}/"
                                 f"{built[k]['timings_still_disturbed']}" for k in ("idle", "busy")))
    ratios = [times["busy"] / times["idle"] for _, _, times in rows]
    print(f"busy/idle median {np.median(ratios):.3f}x, range {min(ratios):.3f}-{max(ratios):.3f}x")
    if args.without_remeasure:
        for seed, built, times in rows:
            plain = built["busy-no-remeasure"]
            print(f"seed {seed}: busy without re-measuring {times['busy-no-remeasure']:.2f} ms "
                  f"({times['busy-no-remeasure'] / times['idle']:.3f}x idle; {plain['trials_measured']} trials, "
                  f"{plain['timings_disturbed']} timings disturbed)")
        plain_ratios = [times["busy-no-remeasure"] / times["idle"] for _, _, times in rows]
        print(f"busy without re-measuring / idle median {np.median(plain_ratios):.3f}x, "
              f"range {min(plain_ratios):.3f}-{max(plain_ratios):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
