"""Where the time goes, layer by layer: a built artifact's kernels beside ONNX Runtime's nodes.

    python benchmarks/layers.py build/host-resnet18/host --model resnet18
    python benchmarks/layers.py OUT/model/host --onnx model.onnx --input-shapes '{"x": [1, 3, 224, 224]}'

Runs the artifact's model.so (TVM's VM, each kernel call timed by the VM's instrument hook) and ONNX
Runtime (its own node profiler) on the same input with the same threads, `--runs` inferences each, and
groups both by the shape of what a kernel or node writes: a convolution stage's kernels (NHWC in the
artifact) and ONNX Runtime's nodes (NCHW, or its blocked NCHWc) of the same output land in one row. The
rows, heaviest gap first, say which layers hold the difference between the two models' latencies.
Per-call timing costs both a little: each side's profiled total is printed beside its plain median.
"""

from __future__ import annotations

import os

_threads = os.environ.get("E2E_THREADS", "2")
for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_name, _threads)  # TVM's pool reads it when it starts

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifact_source import add_artifact_source, checked_artifact, load_source_model
from timing import interleaved_rounds, kernel_calls


@dataclass
class Layer:
    """One output shape's kernels (or nodes): their names, calls and milliseconds per inference."""

    ms: float = 0.0
    calls: int = 0
    names: set[str] = field(default_factory=set)


def shape_key(shape: tuple[int, ...], channels_last: bool) -> str:
    """C x H x W for a 4-D activation in either layout (batch dropped); other ranks as they are."""
    if len(shape) == 4:
        c, h, w = (shape[3], shape[1], shape[2]) if channels_last else (shape[1], shape[2], shape[3])
        return f"{c}x{h}x{w}"
    if len(shape) == 5:  # ONNX Runtime's NCHWc: channel blocks x H x W x block
        return f"{shape[1] * shape[4]}x{shape[2]}x{shape[3]}"
    return "x".join(map(str, shape))


def artifact_layers(vm, args: list, runs: int) -> dict[str, Layer]:
    """Each kernel call's wall time, grouped by the shape of its output (the last argument)."""
    layers: dict[str, Layer] = defaultdict(Layer)
    for symbol, shape, seconds in kernel_calls(vm, args, runs):
        key = shape_key(shape, True) if shape is not None else "(no tensor)"
        layer = layers[key]
        layer.ms += seconds * 1e3 / runs
        layer.calls += 1
        layer.names.add(symbol)
    for layer in layers.values():
        layer.calls //= runs
    return dict(layers)


def onnxruntime_layers(model: bytes | str, feed: dict[str, np.ndarray], threads: int, runs: int) -> dict[str, Layer]:
    """ONNX Runtime's own per-node times (its profiler, all graph optimizations on), grouped likewise."""
    import onnxruntime

    with tempfile.TemporaryDirectory() as scratch:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "ort")
        session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        for _ in range(runs + 1):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    per_run = len(nodes) // (runs + 1)
    layers: dict[str, Layer] = defaultdict(Layer)
    for event in nodes[per_run:]:  # the first run's nodes: one-time costs
        shapes = event.get("args", {}).get("output_type_shape") or [{}]
        shape = tuple(next(iter(shapes[0].values()), ()))
        layer = layers[shape_key(shape, False)]
        layer.ms += event["dur"] / 1e3 / runs
        layer.calls += 1
        layer.names.add(event["args"].get("op_name", "?"))
    for layer in layers.values():
        layer.calls //= runs
    return dict(layers)


def table(ours: dict[str, Layer], theirs: dict[str, Layer]) -> list[dict[str, Any]]:
    """One row per output shape, the largest gap (ours minus theirs) first."""
    rows = []
    for key in set(ours) | set(theirs):
        a, b = ours.get(key, Layer()), theirs.get(key, Layer())
        rows.append({"output": key, "edgetune_ms": a.ms, "edgetune_calls": a.calls,
                     "edgetune_kernels": sorted(a.names), "onnxruntime_ms": b.ms, "onnxruntime_calls": b.calls,
                     "onnxruntime_ops": sorted(b.names), "gap_ms": a.ms - b.ms})
    return sorted(rows, key=lambda r: -r["gap_ms"])


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'output (CxHxW)':16s} {'edgetune ms':>11s} {'calls':>5s} {'ORT ms':>8s} {'calls':>5s} "
          f"{'gap ms':>7s} {'ratio':>6s}  ORT ops / edgetune kernels")
    for r in rows:
        ratio = f"{r['edgetune_ms'] / r['onnxruntime_ms']:.2f}" if r["onnxruntime_ms"] > 0 else "-"
        ops = ",".join(r["onnxruntime_ops"]) or "-"
        kernels = ",".join(k[:28] for k in r["edgetune_kernels"][:3]) or "-"
        print(f"{r['output']:16s} {r['edgetune_ms']:11.3f} {r['edgetune_calls']:5d} {r['onnxruntime_ms']:8.3f} "
              f"{r['onnxruntime_calls']:5d} {r['gap_ms']:+7.3f} {ratio:>6s}  {ops} / {kernels}")
    print(f"{'total':16s} {sum(r['edgetune_ms'] for r in rows):11.3f} {'':5s} "
          f"{sum(r['onnxruntime_ms'] for r in rows):8.3f} {'':5s} {sum(r['gap_ms'] for r in rows):+7.3f}")


PROFILE_DRIFT = 0.15
"""How far a side's profiled total may lie from its plain median before its rows stop comparing."""


def profile_drift(rows: list[dict[str, Any]], plain_ms: dict[str, float]) -> list[str]:
    """A caution per side whose profiled total lies more than PROFILE_DRIFT from its plain median. Per-call
    timing costs each call, and this VM drifts between the two measurements: on a 40-minute MobileNet-V2 (55
    short kernels) ONNX Runtime's nodes summed to 7.78 ms where its plain median was 5.07 ms, and in another
    window the artifact's kernels to 6.53 ms where it ran in 7.32."""
    cautions = []
    for side in ("edgetune", "onnxruntime"):
        total = sum(r[f"{side}_ms"] for r in rows)
        off = total / plain_ms[side] - 1.0
        if abs(off) > PROFILE_DRIFT:
            cautions.append(f"caution: {side}'s profiled total {total:.3f} ms is {off:+.0%} off its plain median "
                            f"{plain_ms[side]:.3f} ms; its rows do not compare at this precision")
    return cautions


def main(argv: list[str] | None = None) -> int:
    parser = add_artifact_source(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--threads", type=int, default=int(_threads))
    parser.add_argument("--runs", type=int, default=20, help="profiled inferences per side")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of plain timing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads != int(os.environ["TVM_NUM_THREADS"]):
        raise SystemExit(f"--threads {args.threads}: run with E2E_THREADS={args.threads} so TVM's pool uses it")
    library = checked_artifact(args)

    import tvm

    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import load_library

    model = load_source_model(args)
    feed = model.sample_inputs()
    vm = load_library(library, tvm.cpu(0))
    tvm_args = [tvm.runtime.tensor(feed[i.name], tvm.cpu(0)) for i in model.inputs]
    session = ReferenceRuntime(model)._session(args.threads)
    runners: dict[str, Callable[[], Any]] = {"edgetune": lambda: vm["main"](*tvm_args),
                                             "onnxruntime": lambda: session.run(None, feed)}
    rounds, _ = interleaved_rounds(runners, args.repeats, 1.0, min_calls=5)
    plain = {name: float(np.median(seconds)) * 1e3 for name, seconds in rounds.items()}
    onnx_bytes = str(args.onnx) if args.onnx else model.proto.SerializeToString()
    rows = table(artifact_layers(vm, tvm_args, args.runs),
                 onnxruntime_layers(onnx_bytes, feed, args.threads, args.runs))
    print_table(rows)
    print(f"plain medians: edgetune {plain['edgetune']:.3f} ms, onnxruntime {plain['onnxruntime']:.3f} ms "
          f"({plain['onnxruntime'] / plain['edgetune']:.3f}x); {args.threads} threads, {args.runs} profiled runs")
    cautions = profile_drift(rows, plain)
    print("\n".join(cautions) if cautions else f"profiled totals within {PROFILE_DRIFT:.0%} of the plain medians")
    if args.json:
        args.json.write_text(json.dumps({"plain_ms": plain, "rows": rows, "cautions": cautions}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
