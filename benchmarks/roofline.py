"""How fast this machine could run a model at most, beside how fast ONNX Runtime (and an artifact) run it.

    python benchmarks/roofline.py --model resnet18 [--artifact build/host-resnet18/host]
    python benchmarks/roofline.py --onnx model.onnx --input-shapes '{"x": [1, 3, 224, 224]}'

Measures the machine first: the rate at which its cores retire vector FMAs (a C loop of independent FMAs
on every thread) and the rate at which they read memory (each thread summing its share of a buffer far
larger than the last-level cache). Then counts the model's arithmetic layer by layer (convolutions and
matrix products, 2 flops per multiply-add) and their weights' bytes. A layer's floor is the larger of
its flops at the peak and its weights read once from memory: a ResNet's weights outgrow the cache, and
the tuner times kernels with their weights flushed, as the model runs them. The model's floor is the
sum. A second floor gives every 3x3 stride-1 convolution Winograd's F(2x2) or F(4x4) where that is
lower: only the batched products' flops and the transformed weights, the transforms for free.

ONNX Runtime (and the artifact) are timed in turns in the same run: ONNX Runtime's time over a floor is
the most any kernels doing that arithmetic could beat it by on this machine.
"""

from __future__ import annotations

import os

_threads = os.environ.get("E2E_THREADS", "2")
for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_name, _threads)  # TVM's pool reads it when it starts

import argparse
import ctypes
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import c_compiler

_PEAK_SOURCE = r"""
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#if defined(__aarch64__)
#define KEEP "+w"
#else
#define KEEP "+x"
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));
#define FMA_ITERATIONS 100000000L
#define READ_BYTES (512L << 20)
static float *buffer;
static int threads;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *fma_loop(void *unused) {
  vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0}, a8 = {0}, a9 = {0}, a10 = {0}, a11 = {0};
  vec x = a0 + 1.0f, y = a0 + 0.5f;
  for (long n = 0; n < FMA_ITERATIONS; n++) {
    a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y; a4 = a4 * x + y; a5 = a5 * x + y;
    a6 = a6 * x + y; a7 = a7 * x + y; a8 = a8 * x + y; a9 = a9 * x + y; a10 = a10 * x + y; a11 = a11 * x + y;
    __asm__ volatile("" : KEEP(a0), KEEP(a1), KEEP(a2), KEEP(a3), KEEP(a4), KEEP(a5));
    __asm__ volatile("" : KEEP(a6), KEEP(a7), KEEP(a8), KEEP(a9), KEEP(a10), KEEP(a11));
  }
  return unused;
}
static void *read_loop(void *index) {
  long count = READ_BYTES / 4 / threads, first = (long)index * count;
  vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
  for (long i = first; i < first + count; i += 4 * LANES) {
    s0 += *(vec *)(buffer + i); s1 += *(vec *)(buffer + i + LANES);
    s2 += *(vec *)(buffer + i + 2 * LANES); s3 += *(vec *)(buffer + i + 3 * LANES);
    __asm__ volatile("" : KEEP(s0), KEEP(s1), KEEP(s2), KEEP(s3));
  }
  return index;
}
static double on_threads(void *(*loop)(void *), int count) {
  pthread_t ids[256];
  double begin = now();
  threads = count;
  for (long i = 0; i < count; i++) pthread_create(&ids[i], 0, loop, (void *)i);
  for (int i = 0; i < count; i++) pthread_join(ids[i], 0);
  return now() - begin;
}
double fma_gflops(int count) { return 2.0 * LANES * 12 * FMA_ITERATIONS * count / on_threads(fma_loop, count) / 1e9; }
double read_gbs(int count) {
  if (!buffer) { buffer = aligned_alloc(64, READ_BYTES); for (long i = 0; i < READ_BYTES / 4; i++) buffer[i] = 1.0f; }
  return READ_BYTES / on_threads(read_loop, count) / 1e9;
}
"""


@dataclass(frozen=True)
class Machine:
    """What this machine's cores reach at most: vector FMA flops and memory reads, per second; and one core's FMA
    rate, to tell a peak measured while another program held a core."""

    peak_gflops: float
    read_gbs: float
    one_core_gflops: float

    def floor_s(self, flops: float, weight_bytes: float) -> float:
        """A layer's least time: its flops at the peak, or its weights read once from memory."""
        return max(flops / (self.peak_gflops * 1e9), weight_bytes / (self.read_gbs * 1e9))

    def caution(self, threads: int) -> str | None:
        """A warning where the threads together reached less than 3/4 of `threads` times one core's rate."""
        if self.peak_gflops >= 0.75 * threads * self.one_core_gflops:
            return None
        return (f"caution: {threads} threads reached {self.peak_gflops:.1f} GFLOPS where one reaches "
                f"{self.one_core_gflops:.1f}: other programs held cores while the peak was measured, and every "
                "floor below is too high; run it again on an idle machine")


def measure_machine(threads: int, turns: int = 5) -> Machine:
    """The best of `turns` runs of each loop (each about 0.2 s), on `threads` threads and on one, built with this
    machine's C compiler for its own vector width (-march=native)."""
    compiler = c_compiler()
    if compiler is None:
        raise SystemExit("roofline: no C compiler (cc or gcc) to build the peak loops with")
    with tempfile.TemporaryDirectory(prefix="edgetune-roofline-") as work:
        source, library = Path(work, "peak.c"), Path(work, "peak.so")
        source.write_text(_PEAK_SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-shared", "-fPIC", "-pthread", str(source),
                        "-o", str(library)], check=True)
        loops = ctypes.CDLL(str(library))
        loops.fma_gflops.restype = loops.read_gbs.restype = ctypes.c_double
        loops.fma_gflops.argtypes = loops.read_gbs.argtypes = [ctypes.c_int]
        return Machine(max(loops.fma_gflops(threads) for _ in range(turns)),
                       max(loops.read_gbs(threads) for _ in range(turns)),
                       max(loops.fma_gflops(1) for _ in range(turns)))


@dataclass
class LayerKind:
    """One kind of layer summed over the model: how many, their flops, their weights' bytes, the two floors (s)."""

    layers: int = 0
    flops: float = 0.0
    weight_bytes: float = 0.0
    floor_s: float = 0.0
    winograd_floor_s: float = 0.0


def winograd_floor_s(machine: Machine, out_h: int, out_w: int, in_channels: int, out_channels: int,
                     batch: int = 1) -> float:
    """A 3x3 stride-1 convolution's least time as F(2x2, 3x3) or F(4x4, 3x3): the batched products of
    (m + 2)^2 per tile and channel pair, the transformed weights (m + 2)^2 / 9 times the 3x3 ones read once."""
    floors = []
    for m in (2, 4):
        alpha = m + 2
        tiles = batch * math.ceil(out_h / m) * math.ceil(out_w / m)
        floors.append(machine.floor_s(2.0 * alpha**2 * tiles * in_channels * out_channels,
                                      4.0 * alpha**2 * in_channels * out_channels))
    return min(floors)


def _attribute(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    found = [a for a in node.attribute if a.name == name]
    return helper.get_attribute_value(found[0]) if found else default


def _conv_kind(node: Any, weight: tuple[int, ...]) -> str:
    groups, strides = _attribute(node, "group", 1), list(_attribute(node, "strides", [1, 1]))
    if groups > 1 and weight[1] == 1:
        return "depthwise convolution"
    kernel = "x".join(map(str, weight[2:]))
    stride = "" if all(s == 1 for s in strides) else f", stride {strides[0]}"
    return f"{kernel} convolution{stride}" + (f", {groups} groups" if groups > 1 else "")


def model_layers(model: Any, machine: Machine) -> dict[str, LayerKind]:
    """Convolutions and matrix products of a loaded ONNX model, at its concrete input shapes, summed by kind."""
    import onnx
    from onnx import numpy_helper, shape_inference

    concrete = onnx.ModelProto()
    concrete.CopyFrom(model.proto)
    given = {i.name: i.shape for i in model.inputs}
    for value in concrete.graph.input:
        for dim, size in zip(value.type.tensor_type.shape.dim, given.get(value.name, ()), strict=False):
            dim.dim_value = size
    graph = shape_inference.infer_shapes(concrete).graph
    shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
              for v in [*graph.value_info, *graph.input, *graph.output]}
    weights = {i.name: tuple(numpy_helper.to_array(i).shape) for i in graph.initializer}
    weights.update({n.output[0]: tuple(onnx.numpy_helper.to_array(_attribute(n, "value", None)).shape)
                    for n in graph.node if n.op_type == "Constant" and _attribute(n, "value", None) is not None})
    kinds: dict[str, LayerKind] = {}
    for node in graph.node:
        counted = _counted_layer(node, shapes, weights, machine)
        if counted is None:
            continue
        kind_name, flops, weight_bytes, winograd = counted
        kind = kinds.setdefault(kind_name, LayerKind())
        floor = machine.floor_s(flops, weight_bytes)
        kind.layers += 1
        kind.flops += flops
        kind.weight_bytes += weight_bytes
        kind.floor_s += floor
        kind.winograd_floor_s += min(floor, winograd) if winograd is not None else floor
    return kinds


def _counted_layer(node: Any, shapes: dict[str, tuple[int, ...]], weights: dict[str, tuple[int, ...]],
                   machine: Machine) -> tuple[str, float, float, float | None] | None:
    """(kind, flops, weights' bytes, Winograd's floor or None) of a convolution or matrix product; None for
    other nodes, or where shapes are not static."""
    out = shapes.get(node.output[0])
    if node.op_type == "Conv" and node.input[1] in weights and out and all(out):
        w = weights[node.input[1]]
        flops = 2.0 * math.prod(out) * math.prod(w[1:])
        kind = _conv_kind(node, w)
        winograd = None
        if kind == "3x3 convolution" and len(out) == 4:
            winograd = winograd_floor_s(machine, out[2], out[3], w[1], w[0], out[0])
        return kind, flops, 4.0 * math.prod(w), winograd
    if node.op_type in ("Gemm", "MatMul") and out and all(out):
        a = shapes.get(node.input[0]) or weights.get(node.input[0])
        b = weights.get(node.input[1]) or shapes.get(node.input[1])
        if not a or not b or not all(a) or not all(b):
            return None
        trans_a = node.op_type == "Gemm" and _attribute(node, "transA", 0)
        inner = a[-2] if trans_a else a[-1]
        weight_bytes = 4.0 * math.prod(b) if node.input[1] in weights else 0.0
        return "matrix product", 2.0 * math.prod(out) * inner, weight_bytes, None
    return None


def print_layers(kinds: dict[str, LayerKind], machine: Machine) -> None:
    total = sum(k.flops for k in kinds.values()) or 1.0
    print(f"machine: {machine.peak_gflops:.1f} GFLOPS of vector FMAs ({machine.one_core_gflops:.1f} on one core), "
          f"{machine.read_gbs:.1f} GB/s read from memory")
    print(f"{'kind of layer':28s} {'layers':>6s} {'GFLOP':>7s} {'share':>6s} {'weights MB':>10s} "
          f"{'floor ms':>9s} {'Winograd':>9s}")
    for name, kind in sorted(kinds.items(), key=lambda item: -item[1].flops):
        print(f"{name:28s} {kind.layers:6d} {kind.flops / 1e9:7.3f} {kind.flops / total:6.1%} "
              f"{kind.weight_bytes / 1e6:10.2f} {kind.floor_s * 1e3:9.3f} {kind.winograd_floor_s * 1e3:9.3f}")


def timed_models(model: Any, model_source: dict, artifact: Path | None, threads: int,
                 repeats: int) -> dict[str, float]:
    """Median ms of ONNX Runtime, and of the artifact with its threads waiting as it ships them: then both are
    timed in turns in a process of its own (`busy_machine.time_artifacts`: TVM's pool reads how its threads
    wait once per process)."""
    if artifact is not None:
        from busy_machine import time_artifacts

        times = time_artifacts(model_source, {"artifact": artifact / "model.so"}, repeats)
        return {"onnxruntime": times.reference_ms("artifact"), "artifact": times.ms("artifact")}
    from edgetune.reference import ReferenceRuntime

    return {"onnxruntime": ReferenceRuntime(model).time(model.sample_inputs(), threads, min_total_s=float(repeats))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a zoo model")
    source.add_argument("--onnx", type=Path, help="an ONNX file")
    parser.add_argument("--input-shapes", help='e.g. {"x": [1, 3, 224, 224]}')
    parser.add_argument("--artifact", type=Path, help="a build's artifact directory, timed beside ONNX Runtime "
                        "in a process of its own, its threads waiting as it ships them")
    parser.add_argument("--threads", type=int, default=int(_threads))
    parser.add_argument("--repeats", type=int, default=5, help="rounds of timing in turns with an artifact; "
                        "without, the seconds ONNX Runtime is timed for")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads != int(os.environ["TVM_NUM_THREADS"]):
        raise SystemExit(f"--threads {args.threads}: run with E2E_THREADS={args.threads} so TVM's pool uses it")
    if args.artifact is not None and (args.threads != 2 or not (args.artifact / "model.so").is_file()):
        raise SystemExit(f"--artifact {args.artifact}: give the artifact directory of a build (model.so), timed on 2 "
                         "threads (busy_machine.time_artifacts)")
    from edgetune.errors import InputError
    from edgetune.frontend.onnx import load_model

    try:
        shapes = json.loads(args.input_shapes) if args.input_shapes else None
        model = load_model(zoo=args.model, onnx_path=args.onnx, input_shapes=shapes)
    except (json.JSONDecodeError, InputError) as exc:
        raise SystemExit(f"roofline: {exc}") from None
    machine = measure_machine(args.threads)
    kinds = model_layers(model, machine)
    print_layers(kinds, machine)
    caution = machine.caution(args.threads)
    if caution:
        print(caution)
    if not kinds:
        raise SystemExit("roofline: no convolution or matrix product with static shapes in the model")
    floors = {"direct": sum(k.floor_s for k in kinds.values()) * 1e3,
              "winograd": sum(k.winograd_floor_s for k in kinds.values()) * 1e3}
    source = {"zoo": args.model} if args.model else {"onnx": str(args.onnx), "input_shapes": shapes}
    timed = timed_models(model, source, args.artifact, args.threads, args.repeats)
    print(f"floor {floors['direct']:.3f} ms (direct), {floors['winograd']:.3f} ms (Winograd where lower); "
          f"ONNX Runtime {timed['onnxruntime']:.3f} ms, at most {timed['onnxruntime'] / floors['direct']:.2f}x "
          f"its speed by direct arithmetic, {timed['onnxruntime'] / floors['winograd']:.2f}x with Winograd")
    if "artifact" in timed:
        print(f"artifact {timed['artifact']:.3f} ms: {timed['onnxruntime'] / timed['artifact']:.2f}x ONNX Runtime, "
              f"{floors['winograd'] / timed['artifact']:.0%} of the Winograd floor's speed")
    if args.json:
        args.json.write_text(json.dumps({"machine": vars(machine), "floors_ms": floors, "timed_ms": timed,
                                         "layers": {name: vars(kind) for name, kind in kinds.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
