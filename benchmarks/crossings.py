"""What an artifact's kernels lose inside the model against alone, with the VM's two CPUs together and apart.

    python benchmarks/crossings.py OUT/host --model resnet18 --rounds 40

Inside the model, a kernel reads what the kernels before it wrote, each part on the thread that wrote it; alone
(called again and again on a copy of the same arguments), each thread reads what it read the call before. With
the two CPUs apart (no shared L3, `placement.py`) every line one thread wrote and the other reads crosses between
them, so (inside - alone) apart minus (inside - alone) together is what the model's layer-to-layer crossings cost;
each kernel's own loss apart (alone apart - alone together) is what crosses inside it. Each round probes the
placement before and after and times the model, every kernel inside it (the VM's instrument hook) and every kernel
alone; rounds whose placement moved during them are counted on their own and left out of the comparison. Runs
on the artifact's own thread pool where it ships one.
"""

from __future__ import annotations

import os

_threads = os.environ.get("E2E_THREADS", "2")
for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_name, _threads)  # TVM's pool reads it when it starts

import argparse
import functools
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifact_source import add_artifact_source, checked_artifact, load_source_model
from placement import CoreDistance, placement
from timing import kernel_calls, sample_calls


def _is_kernel(call_args: tuple) -> bool:
    """A call of a compiled kernel: its arguments all tensors (the VM's builtins take shapes or strings too)."""
    return bool(call_args) and all(hasattr(a, "numpy") for a in call_args)


def captured_kernels(vm, args: list) -> list[tuple[str, Any, list]]:
    """Every kernel call of one inference: (symbol, the function, a copy of its arguments). Copies: holding the
    VM's own tensors would keep their storage from its pool (see `timing.kernel_calls`)."""
    import tvm

    calls: list[tuple[str, Any, list]] = []

    def instrument(func, symbol, before_run, ret_value, *call_args) -> int:
        if before_run and _is_kernel(call_args):
            calls.append((str(symbol), func, [tvm.runtime.tensor(a.numpy(), a.device) for a in call_args]))
        return 0  # VMInstrumentReturnKind.NO_OP

    vm["main"](*args)
    vm.set_instrument(instrument)
    vm["main"](*args)
    vm.set_instrument(None)
    return calls


def alone_seconds(kernels: list[tuple[str, Any, list]], calls: int) -> list[float]:
    """Each captured call's median seconds, called `calls` times in a row after one call not timed."""
    medians = []
    for _, func, arguments in kernels:
        func(*arguments)
        medians.append(float(np.median(sample_calls(functools.partial(func, *arguments), 0.0, calls))))
    return medians


def inside_seconds(vm, args: list, runs: int, count: int) -> tuple[float, list[float]]:
    """The model's median seconds over `runs` plain inferences, then each of its `count` kernel calls' median
    seconds inside `runs` instrumented ones (in call order)."""
    plain = sample_calls(lambda: vm["main"](*args), 0.0, runs)
    samples = [seconds for _, _, seconds in kernel_calls(vm, args, runs, only=_is_kernel)]
    if len(samples) != runs * count:
        raise SystemExit(f"{len(samples)} kernel calls in {runs} inferences: expected {count} each")
    per_call = np.array(samples).reshape(runs, count)
    return float(np.median(plain)), [float(x) for x in np.median(per_call, axis=0)]


def timed_rounds(vm, args: list, kernels: list, rounds: int, runs: int) -> dict[str, list[dict[str, Any]]]:
    """Rounds grouped by the CPUs' placement: each the model's seconds and every kernel's inside and alone."""
    probe = CoreDistance()
    by_placement: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for index in range(rounds):
        before = probe.round_trip_ns()
        model_s, inside = inside_seconds(vm, args, runs, len(kernels))
        alone = alone_seconds(kernels, runs)
        where = placement(before, probe.round_trip_ns())
        by_placement[where].append({"model_s": model_s, "inside_s": inside, "alone_s": alone})
        print(f"round {index + 1}/{rounds}: {where}, model {model_s * 1e3:.2f} ms, kernels inside "
              f"{sum(inside) * 1e3:.2f}, alone {sum(alone) * 1e3:.2f}", flush=True)
    return by_placement


def summary(kernels: list, by_placement: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per placement: the model, the kernels' sums inside and alone, and each kernel's pair."""
    result: dict[str, Any] = {}
    for where, rounds in by_placement.items():
        inside = np.median([r["inside_s"] for r in rounds], axis=0) * 1e3
        alone = np.median([r["alone_s"] for r in rounds], axis=0) * 1e3
        result[where] = {"rounds": len(rounds), "model_ms": float(np.median([r["model_s"] for r in rounds]) * 1e3),
                         "inside_ms": float(inside.sum()), "alone_ms": float(alone.sum()),
                         "kernels": [{"call": i, "symbol": kernels[i][0], "inside_ms": float(inside[i]),
                                      "alone_ms": float(alone[i])} for i in range(len(kernels))]}
    return result


def print_report(result: dict[str, Any], top: int) -> None:
    """The sums per placement, then the calls that lose most apart, inside the model and alone."""
    for where, r in sorted(result.items()):
        print(f"{where:9s} {r['rounds']:3d} rounds: model {r['model_ms']:.2f} ms, kernels inside {r['inside_ms']:.2f}"
              f", alone {r['alone_ms']:.2f} (inside - alone {r['inside_ms'] - r['alone_ms']:+.2f})")
    if "together" not in result or "apart" not in result:
        print("no rounds in both placements: nothing to set side by side")
        return
    together, apart = result["together"]["kernels"], result["apart"]["kernels"]
    print(f"\ncalls losing most apart (ms: inside together / apart, alone together / apart), top {top}:")
    lost = sorted(range(len(together)), key=lambda i: together[i]["inside_ms"] - apart[i]["inside_ms"])
    for i in lost[:top]:
        t, a = together[i], apart[i]
        print(f"  #{i:3d} {t['symbol'][:40]:40s} {t['inside_ms']:7.3f} / {a['inside_ms']:7.3f}   "
              f"{t['alone_ms']:7.3f} / {a['alone_ms']:7.3f}")
    crossing = (result["apart"]["inside_ms"] - result["apart"]["alone_ms"]) - (
        result["together"]["inside_ms"] - result["together"]["alone_ms"])
    own = result["apart"]["alone_ms"] - result["together"]["alone_ms"]
    print(f"\napart loses {result['apart']['model_ms'] - result['together']['model_ms']:+.2f} ms of the model: "
          f"{own:+.2f} inside the kernels themselves (alone), {crossing:+.2f} between them (inside - alone)")


def main(argv: list[str] | None = None) -> int:
    parser = add_artifact_source(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--runs", type=int, default=10, help="inferences (and calls of each kernel alone) a round")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    library = checked_artifact(args)

    import tvm

    from edgetune.runtime import load_library

    model = load_source_model(args)
    feed = model.sample_inputs()
    pool = library.parent / "threads.so"
    vm = load_library(library, tvm.cpu(0), pool if pool.is_file() else None)
    tvm_args = [tvm.runtime.tensor(feed[i.name], tvm.cpu(0)) for i in model.inputs]
    kernels = captured_kernels(vm, tvm_args)
    result = summary(kernels, timed_rounds(vm, tvm_args, kernels, args.rounds, args.runs))
    print_report(result, args.top)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
