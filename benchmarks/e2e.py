"""End to end: edgetune's tuned artifact vs ONNX Runtime vs PyTorch CPU, side by side on this machine.

    python benchmarks/e2e.py --model resnet18 --budget-min 60 --json out.json
    python benchmarks/e2e.py --model resnet18 --reuse build/bench-e2e/e2e-resnet18 --json out.json

Builds the zoo model with `edgetune.pipeline.build` (host profile, `--threads` cores, the given
tuning budget), or, with `--reuse DIR` (a build's `<output>/<recipe>` directory, the one holding
summary.json), compiles again with the records that build's store holds (`trials_per_task: 0`, same
recipe name and output, so the pipeline finds its own store wherever it keeps it). Then, in this one
process, times the artifact's model.so (TVM's runtime), ONNX Runtime and PyTorch eager on the same
input with the same thread count, interleaved over `--repeats` rounds so drifts of a shared machine
hit all three, and reports medians, the spread, and speedup_vs_onnxruntime / speedup_vs_torch
(their latency / ours).

PyTorch runs the very ONNX graph of the zoo model (same weights), executed op by op with
torch.nn.functional (the zoo emits only Conv, Relu, Clip, Add, MaxPool, GlobalAveragePool, Flatten
and Gemm), so its output is checked against ONNX Runtime's too.
"""

from __future__ import annotations

import os

THREADS_ENV = ("TVM_NUM_THREADS", "OMP_NUM_THREADS")
# TVM's and OpenMP's thread pools read these when they start: set before any import that starts them.
_threads = os.environ.get("E2E_THREADS", "2")
for _name in THREADS_ENV:
    os.environ.setdefault(_name, _threads)

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import CoreDistance, placement
from timing import interleaved_rounds, kernel_calls


def recipe_text(name: str, model: str, threads: int, trials: int, budget_min: float | None, search: str,
                output: Path, in_model_candidates: int) -> str:
    """A one-target recipe for this machine; `trials` 0 compiles with the store's records only."""
    budget = f"\n  time_budget_min: {budget_min}" if budget_min else ""
    return f"""name: {name}
model:
  zoo: {model}
fleet:
  - name: host
    profile: host
    overrides: {{hardware: {{cores: {threads}}}}}
    connection: local
tuning:
  trials_per_task: {trials}{budget}
  search: {search}
  in_model_candidates: {in_model_candidates}
  seed: 0
output: {output}
"""


def build_artifact(text: str) -> dict[str, Any]:
    """Run edgetune's pipeline; return the target's summary plus the wall time spent before compiling."""
    from edgetune.pipeline import build
    from edgetune.recipe import load_recipe_text

    recipe = load_recipe_text(text, "e2e recipe", REPO)
    started = time.monotonic()
    marks: dict[str, float] = {}

    def on_event(event) -> None:
        if event.task is not None:
            p = event.task
            best = f"{p.best_us:.0f} us" if p.best_us else "-"
            print(f"  [{p.elapsed_s:6.0f} s] task {p.index}/{p.total} {p.task}: {p.trials_done}/{p.trials_planned}"
                  f" trials, best {best}", flush=True)
            return
        if event.message.startswith("compiling") and "compile" not in marks:
            marks["compile"] = time.monotonic() - started
        print(f"  {event.message}", flush=True)

    result = build(recipe, on_event=on_event)
    target = result.targets["host"]
    if target.error:
        raise SystemExit(f"edgetune build failed: {target.error}")
    summary = json.loads(json.dumps(result.to_json()["targets"]["host"]))
    summary["tuning_wall_s"] = marks.get("compile")  # import + task extraction + tuning + in-model selection
    summary["build_wall_s"] = time.monotonic() - started
    return summary


def torch_runner(proto, threads: int) -> Callable[[np.ndarray], np.ndarray] | str:
    """The ONNX graph executed with torch.nn.functional (same weights); a reason string if torch is absent."""
    try:
        import torch
        import torch.nn.functional as F
        from onnx import helper, numpy_helper
    except ImportError as exc:
        return f"torch not installed ({exc}); `pip install torch==2.13.0` installs the local CPU wheel"
    torch.set_num_threads(threads)
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in proto.graph.initializer}
    nodes = [(n.op_type, list(n.input), n.output[0], {a.name: helper.get_attribute_value(a) for a in n.attribute})
             for n in proto.graph.node]
    input_name = next(i.name for i in proto.graph.input if i.name not in weights)
    output_name = proto.graph.output[0].name

    def conv(x, w, b, attrs):
        pads = attrs.get("pads", [0, 0, 0, 0])
        return F.conv2d(x, w, b, stride=tuple(attrs.get("strides", [1, 1])), padding=(pads[0], pads[1]),
                        groups=attrs.get("group", 1))

    ops = {
        "Conv": lambda a, at: conv(a[0], a[1], a[2] if len(a) > 2 else None, at),
        "Relu": lambda a, at: F.relu(a[0]),
        "Clip": lambda a, at: torch.clamp(a[0], float(a[1]), float(a[2])),
        "Add": lambda a, at: a[0] + a[1],
        "MaxPool": lambda a, at: F.max_pool2d(a[0], at["kernel_shape"], at["strides"], at["pads"][0]),
        "GlobalAveragePool": lambda a, at: F.adaptive_avg_pool2d(a[0], 1),
        "Flatten": lambda a, at: torch.flatten(a[0], at.get("axis", 1)),
        "Gemm": lambda a, at: F.linear(a[0], a[1] if at.get("transB") else a[1].T, a[2]),
    }

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            values = dict(weights)
            values[input_name] = torch.from_numpy(x)
            for op, inputs, output, attrs in nodes:
                values[output] = ops[op]([values[i] for i in inputs], attrs)
            return values[output_name].numpy()

    return run


def kernel_profile(vm, args: list, runs: int) -> list[dict[str, Any]]:
    """Wall time per kernel (VM call) per inference, heaviest first: where the model's time goes."""
    totals: dict[str, float] = {}
    calls: dict[str, int] = {}
    for symbol, _, seconds in kernel_calls(vm, args, runs):
        totals[symbol] = totals.get(symbol, 0.0) + seconds
        calls[symbol] = calls.get(symbol, 0) + 1
    whole = sum(totals.values())
    return [{"kernel": k, "ms": v / runs * 1e3, "calls": calls[k] // runs, "share": v / whole}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]


def time_side_by_side(runners: dict[str, Callable[[], Any]], repeats: int, min_s: float) -> dict[str, dict]:
    """Each system's median per round, rounds interleaved; median over rounds, with min and max, in ms; each
    round's placement of the CPUs (`placement.py`: a ratio timed with them together does not hold apart).

    `best_ms` (the fastest single call) is less sensitive than the medians to other work on a shared machine.
    """
    distance = CoreDistance()
    round_trips = [distance.round_trip_ns()]
    placements: list[str] = []

    def report_round(index: int, rounds: dict[str, list[float]]) -> None:
        round_trips.append(distance.round_trip_ns())
        placements.append(placement(round_trips[-2], round_trips[-1]))
        print(f"  round {index + 1} (CPUs {placements[-1]}): "
              + ", ".join(f"{n} {v[-1] * 1e3:.2f} ms" for n, v in rounds.items()), flush=True)

    rounds, best = interleaved_rounds(runners, repeats, min_s, min_calls=5, on_round=report_round)
    result = {}
    for name, seconds in rounds.items():
        v = [s * 1e3 for s in seconds]
        result[name] = {"median_ms": float(np.median(v)), "min_ms": min(v), "max_ms": max(v),
                        "best_ms": best[name] * 1e3, "rounds_ms": v, "placements": placements}
    return result


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.reuse:
        reuse = args.reuse.resolve()
        if not (reuse / "summary.json").is_file():
            raise SystemExit(f"--reuse {reuse}: no summary.json; give a build's <output>/<recipe> directory")
        text = recipe_text(reuse.name, args.model, args.threads, 0, None, args.search, reuse.parent,
                           args.in_model_candidates)
    else:
        text = recipe_text(f"e2e-{args.model}", args.model, args.threads, args.trials_per_task, args.budget_min,
                           args.search, args.output.resolve(), args.in_model_candidates)
    print(f"building {args.model} with edgetune ({'reusing ' + str(args.reuse) if args.reuse else 'tuning'})",
          flush=True)
    summary = build_artifact(text)
    systems = _Systems(args.model, Path(summary["artifact_dir"]), args.threads)
    print(f"timing {', '.join(systems.runners)} at {args.threads} threads, {args.repeats} rounds", flush=True)
    times = time_side_by_side(systems.runners, args.repeats, args.min_seconds)
    profile = kernel_profile(systems.vm, [systems.tvm_input], args.profile) if args.profile else []
    for row in profile[:12]:
        print(f"  {row['kernel']:40s} {row['ms']:8.2f} ms x{row['calls']} {row['share']:6.1%}")
    report = _report(args, argv, summary, systems, times, profile)
    ours = times["edgetune"]["median_ms"]
    print(f"\n{args.model}: edgetune {ours:.2f} ms [{times['edgetune']['min_ms']:.2f}-{times['edgetune']['max_ms']:.2f}]"
          + "".join(f", {n} {t['median_ms']:.2f} ms [{t['min_ms']:.2f}-{t['max_ms']:.2f}]"
                    for n, t in times.items() if n != "edgetune"))
    tuning_s = summary.get("tuning_wall_s")
    vs_torch = f"{report['speedup_vs_torch']:.3f}" if report["speedup_vs_torch"] else "n/a"
    print(f"speedup_vs_onnxruntime {report['speedup_vs_onnxruntime']:.3f}, speedup_vs_torch {vs_torch}; "
          f"fastest calls: " + ", ".join(f"{n} {t['best_ms']:.2f} ms" for n, t in times.items())
          + f"; tuning wall {tuning_s or 0:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("resnet18", "mobilenet_v2"), default="resnet18")
    parser.add_argument("--budget-min", type=float, default=60.0, help="tuning time budget (checked between tasks)")
    parser.add_argument("--trials-per-task", type=int, default=512, help="trial cap per task within the budget")
    parser.add_argument("--search", choices=("evolutionary", "draft-verify"), default="evolutionary")
    parser.add_argument("--in-model-candidates", type=int, default=4,
                        help="schedules per kernel compared inside the model before packaging (1: the tuner's best)")
    parser.add_argument("--output", type=Path, default=REPO / "build" / "bench-e2e")
    parser.add_argument("--reuse", type=Path, help="a build's <output>/<recipe> directory: compile with its records")
    parser.add_argument("--threads", type=int, default=int(_threads),
                        help="threads for all three (set E2E_THREADS too, so TVM's pool starts with it)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=1.0, help="timing per system per round")
    parser.add_argument("--profile", type=int, default=10, metavar="RUNS",
                        help="per-kernel times of the artifact over RUNS inferences (0: skip)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads != int(os.environ["TVM_NUM_THREADS"]):
        raise SystemExit(f"--threads {args.threads}: run with E2E_THREADS={args.threads} so TVM's pool uses it")
    return args


class _Systems:
    """The artifact, ONNX Runtime and (where installed) PyTorch on the zoo model's sample input, each a runner,
    with each one's largest difference from ONNX Runtime's output."""

    def __init__(self, model_name: str, artifact_dir: Path, threads: int) -> None:
        import tvm

        from edgetune.frontend.onnx import load_model
        from edgetune.reference import ReferenceRuntime
        from edgetune.runtime import load_library

        model = load_model(zoo=model_name, onnx_path=None, input_shapes=None)
        x = model.sample_inputs()[model.inputs[0].name]
        device = tvm.cpu(0)
        self.vm = load_library(artifact_dir / "model.so", device)
        self.tvm_input = tvm.runtime.tensor(x, device)
        session = ReferenceRuntime(model)._session(threads)
        feed = {model.inputs[0].name: x}
        self.runners: dict[str, Callable[[], Any]] = {
            "edgetune": lambda: self.vm["main"](self.tvm_input),
            "onnxruntime": lambda: session.run(None, feed),
        }
        self.torch = torch_runner(model.proto, threads)
        expected = session.run(None, feed)[0]
        self.errors = {"edgetune": float(np.abs(_first(self.vm["main"](self.tvm_input)) - expected).max())}
        if callable(self.torch):
            torch_run = self.torch
            self.runners["torch"] = lambda: torch_run(x)
            self.errors["torch"] = float(np.abs(torch_run(x) - expected).max())


def _report(args: argparse.Namespace, argv: list[str] | None, summary: dict[str, Any], systems: _Systems,
            times: dict[str, Any], profile: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's JSON report: the build, the versions, the errors, the per-kernel profile and the timings."""
    import onnxruntime
    import tvm

    ours = times["edgetune"]["median_ms"]
    return {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "model": args.model,
        "threads": args.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores_visible": os.cpu_count()},
        "versions": {"tvm": tvm.__version__, "onnxruntime": onnxruntime.__version__, "torch": _torch_version()},
        "torch": "ONNX graph run op by op with torch.nn.functional, same weights" if callable(systems.torch)
        else f"skipped: {systems.torch}",
        "build": {k: summary.get(k) for k in ("artifact_dir", "tuning_wall_s", "build_wall_s", "trials_measured",
                                              "trials_total", "tasks_total", "latency_ms", "reference_latency_ms",
                                              "untuned_latency_ms", "verification")},
        "tuning": {"reused": str(args.reuse) if args.reuse else None, "budget_min": None if args.reuse
                   else args.budget_min, "trials_per_task": 0 if args.reuse else args.trials_per_task,
                   "search": args.search, "tasks": summary["tasks"]},
        "max_abs_error_vs_onnxruntime": systems.errors,
        "kernel_profile": profile,
        "latency": times,
        "speedup_vs_onnxruntime": times["onnxruntime"]["median_ms"] / ours,
        "speedup_vs_torch": times["torch"]["median_ms"] / ours if "torch" in times else None,
        "speedup_vs_onnxruntime_best": times["onnxruntime"]["best_ms"] / times["edgetune"]["best_ms"],
        "speedup_vs_torch_best": times["torch"]["best_ms"] / times["edgetune"]["best_ms"] if "torch" in times
        else None,
    }


def _first(result) -> np.ndarray:
    return result.numpy() if hasattr(result, "numpy") else _first(result[0])


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


if __name__ == "__main__":
    raise SystemExit(main())
