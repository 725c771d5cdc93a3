"""Kernels: every conv2d and gemm of ../shared/workloads.yaml tuned by edgetune, vs PyTorch CPU, with GFLOPS.

    python benchmarks/kernels.py --trials 64 --json out.json
    python benchmarks/kernels.py --workloads C2,C6,G1 --trials 32 --prepack --json out.json
    python benchmarks/kernels.py --workloads C2,C6,C9 --trials 32 --prepack --layout NCHW --json nchw.json

Each workload (fp32 conv2d with padding K//2, channels-last as edgetune compiles convolutions for
CPUs, or NCHW as models are imported with `--layout NCHW`; or an fp32 matmul, built as in
benchmarks/search_efficiency.py) is tuned with edgetune's own tuning loop (`edgetune.tuning.tune.tune`:
its builder, runner, search and record store; the store under `--work` is a cache, so a second run with
the same `--trials` measures nothing and only re-times). The best schedule is then built and timed with
TVM's time_evaluator, interleaved with torch.nn.functional.conv2d / torch.matmul on the same shapes at the
same thread count, over `--repeats` rounds.

`--prepack` marks the weight as layout-free (as edgetune's fuse_for_tuning does for every constant weight
of a model, through relax's AttachAttrLayoutFreeBuffers), so MetaSchedule may rewrite its layout; the
kernel is timed on the pre-packed weight, as the compiled model runs it (compile_model packs constants at
compile time). Without it the weight keeps its layout (HWIO, OIHW, or K x N).

Peak = cores x FLOP/cycle x clock, from edgetune's host profile (FLOP/cycle from the SIMD width it
detects: 2 FMA units x lanes x 2); the issue's formula (64 FLOP/cycle, AVX-512) is reported beside it.
"""

from __future__ import annotations

import os

_threads = os.environ.get("KERNELS_THREADS", "2")
for _name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_name, _threads)  # read when the thread pools start: before tvm or torch load

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_efficiency import DEFAULT_WORKLOADS, REPO, build_workload, load_workloads
from timing import interleaved_rounds

ISSUE_FLOPS_PER_CYCLE = 64


def workload_flops(shape: dict[str, int]) -> float:
    """Multiply-adds x 2 of the conv2d (padding K//2) or matmul."""
    if {"M", "N", "K"} <= shape.keys():
        return 2.0 * shape["M"] * shape["N"] * shape["K"]
    out_h = (shape["H"] + 2 * (shape["K"] // 2) - shape["K"]) // shape["S"] + 1
    out_w = (shape["W"] + 2 * (shape["K"] // 2) - shape["K"]) // shape["S"] + 1
    return 2.0 * shape["OC"] * out_h * out_w * shape["IC"] * shape["K"] ** 2


def winograd_tile(policy, shape: dict[str, int], layout: str) -> int | None:
    """The Winograd tile edgetune's policy gives this workload (None: a direct convolution or a GEMM)."""
    if policy is None or layout != "NHWC" or "IC" not in shape or (shape["K"], shape["S"]) != (3, 1):
        return None
    return policy.tile(1, shape["H"], shape["W"], shape["IC"], shape["OC"])


def mark_weight_layout_free(mod):
    """Let MetaSchedule's RewriteLayout pack the weight (argument 1), as it may for a model's constants."""
    import tvm

    return tvm.IRModule({"main": mod["main"].with_attr("layout_free_buffers", [1])})


def tvm_runner(store, mod, target, device) -> Callable[[], None]:
    """The best record's schedule built as the tuner measured it (weight in its tuned layout), ready to call."""
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.tir_integration import compile_tir

    from edgetune.tuning.builder import build_candidate

    schedule = compile_tir(store.database, mod, target)
    if schedule is None:
        raise SystemExit("no valid record for a tuned workload; raise --trials")
    library = build_candidate(schedule.mod, target, None)
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal([int(d) for d in info.shape]).astype(info.dtype), device)
            for info in ArgInfo.from_entry_func(schedule.mod, remove_preproc=True)]
    function = library["main"]
    return lambda: function(*args)


def torch_runner(shape: dict[str, int], threads: int) -> Callable[[], Any]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    if {"M", "N", "K"} <= shape.keys():
        a, b = torch.randn(shape["M"], shape["K"]), torch.randn(shape["K"], shape["N"])
        return lambda: torch.matmul(a, b)
    x = torch.randn(1, shape["IC"], shape["H"], shape["W"])
    w = torch.randn(shape["OC"], shape["IC"], shape["K"], shape["K"])

    def conv():
        with torch.inference_mode():
            return F.conv2d(x, w, stride=shape["S"], padding=shape["K"] // 2)

    return conv


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    threads = int(os.environ["TVM_NUM_THREADS"])
    tuned = _tune_workloads(args, threads)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "target": str(tuned.target),
        "threads": threads,
        "peak_gflops": tuned.peak,
        "peak_formula": tuned.peak_formula,
        "issue_peak_gflops": tuned.issue_peak,
        "trials": args.trials,
        "search": args.search,
        "prepack": args.prepack,
        "layout": args.layout,
        "winograd": args.winograd,
        "tuning_wall_s": tuned.tuning.wall_s,
        "workloads": {name: _time_workload(name, shape, tuned, args, threads)
                      for name, shape in tuned.workloads.items()},
    }
    speedups = [w["speedup_vs_torch"] for w in report["workloads"].values()]
    report["geomean_speedup_vs_torch"] = float(np.exp(np.mean(np.log(speedups))))
    report["at_least_torch"] = sum(s >= 1.0 for s in speedups)
    print(f"\ngeomean speedup vs torch {report['geomean_speedup_vs_torch']:.2f}; {report['at_least_torch']} of "
          f"{len(speedups)} at least as fast as torch; tuning wall {tuned.tuning.wall_s:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="C1,C2,C3,C4,C5,C6,C7,C8,C9,C10,C11,C12,G1,G2")
    parser.add_argument("--workloads-file", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--trials", type=int, default=64, help="measurements per workload (across runs)")
    parser.add_argument("--search", choices=("evolutionary", "draft-verify"), default="evolutionary")
    parser.add_argument("--prepack", action="store_true", help="let the tuner pack the weight (layout-free)")
    parser.add_argument("--layout", choices=("NHWC", "NCHW"), default="NHWC",
                        help="conv2d data layout (NHWC/HWIO: what edgetune tunes on CPU targets)")
    parser.add_argument("--winograd", action="store_true",
                        help="3x3 stride-1 NHWC convolutions by Winograd where edgetune's policy for this "
                             "machine's profile picks it, with the tile it picks (as edgetune compiles them)")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "bench-kernels",
                        help="record stores (one per --prepack setting): reruns resume")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.3, help="timing per system per round")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


@dataclass
class _Tuned:
    """What tuning the workloads left for their timing: the modules, their tiles, the store and its outcome."""

    target: Any
    peak: float
    peak_formula: str
    issue_peak: float
    workloads: dict[str, dict[str, int]]
    mods: dict[str, Any]
    tiles: dict[str, int | None]
    store: Any
    tuning: Any


def _tune_workloads(args: argparse.Namespace, threads: int) -> _Tuned:
    """Every workload built as asked and tuned with edgetune's own loop, on the host profile at `threads` cores."""
    from edgetune.frontend.winograd import WinogradPolicy
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.database.store import RecordStore
    from edgetune.tuning.tasks import TuningTask
    from edgetune.tuning.tune import TuningPlan, tune

    profile = resolve_profile("host", {"hardware": {"cores": threads}})
    hw = profile.hardware
    target = profile.tvm_target()
    peak = float(hw.peak_gflops)
    formula = f"{threads} cores x {hw.flops_per_cycle} FLOP/cycle x {hw.clock_ghz} GHz"
    issue_peak = threads * ISSUE_FLOPS_PER_CYCLE * hw.clock_ghz
    print(f"target {target}; peak {peak:.1f} GFLOPS = {formula} (issue's formula, 64 FLOP/cycle: {issue_peak:.1f})",
          flush=True)

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    workloads = load_workloads(args.workloads_file, names)
    policy = WinogradPolicy(float(hw.peak_gflops), hw.memory_bandwidth_gbs) if args.winograd else None
    tiles = {n: winograd_tile(policy, s, args.layout) for n, s in workloads.items()}
    mods = {n: build_workload(n, s, args.layout, tiles[n]) for n, s in workloads.items()}
    if args.prepack:
        mods = {n: mark_weight_layout_free(m) for n, m in mods.items()}
    tasks = [TuningTask(n, mods[n], 1, workload_flops(s)) for n, s in workloads.items()]
    variant = (("prepack" if args.prepack else "plain") + ("-nchw" if args.layout == "NCHW" else "")
               + ("-winograd" if args.winograd else ""))
    store = RecordStore(args.work / variant / "records")
    plan = TuningPlan(trials_per_task=args.trials, time_budget_s=None, search=args.search, seed=0, cores=threads,
                      hardware=hw, device=profile.device, isa=profile.isa)

    def progress(p) -> None:
        best = f"{p.best_us:.0f} us" if p.best_us else "-"
        print(f"  [{p.elapsed_s:6.0f} s] {p.task}: {p.trials_done}/{p.trials_planned} trials, best {best}", flush=True)

    tuning = tune(tasks, target, store, plan, progress)
    return _Tuned(target, peak, formula, issue_peak, workloads, mods, tiles, store, tuning)


def _time_workload(name: str, shape: dict[str, int], tuned: _Tuned, args: argparse.Namespace,
                   threads: int) -> dict[str, Any]:
    """The workload's best schedule and PyTorch timed in turns; its line printed, its report entry returned."""
    import tvm

    runners = {"edgetune": tvm_runner(tuned.store, tuned.mods[name], tuned.target, tvm.cpu(0)),
               "torch": torch_runner(shape, threads)}
    seconds, fastest = interleaved_rounds(runners, args.repeats, args.min_seconds, min_calls=10)
    rounds = {k: [s * 1e6 for s in v] for k, v in seconds.items()}
    best = {k: s * 1e6 for k, s in fastest.items()}
    ours, theirs = float(np.median(rounds["edgetune"])), float(np.median(rounds["torch"]))
    flops = workload_flops(shape)
    tile = tuned.tiles[name]
    task = next(t for t in tuned.tuning.tasks if t.name == name)
    entry = {
        "shape": shape,
        "gflop": flops / 1e9,
        "edgetune_us": ours,
        "torch_us": theirs,
        "rounds_us": rounds,
        "speedup_vs_torch": theirs / ours,
        "best_us": best,  # fastest single call: less sensitive to a busy shared machine than the medians
        "speedup_vs_torch_best": best["torch"] / best["edgetune"],
        "gflops": flops / ours / 1e3,
        "torch_gflops": flops / theirs / 1e3,
        "fraction_of_peak": flops / ours / 1e3 / tuned.peak,
        "winograd_tile": tile,
        "tuned_best_us": task.best_us,
        "tuning_s_this_run": task.tuning_s,
    }
    algorithm = f" (winograd F({tile}x{tile},3x3))" if tile else ""
    print(f"{name}{algorithm}: edgetune {ours:.0f} us ({entry['gflops']:.0f} GFLOPS, {entry['fraction_of_peak']:.0%} of "
          f"peak), torch {theirs:.0f} us ({entry['torch_gflops']:.0f} GFLOPS); speedup vs torch "
          f"{entry['speedup_vs_torch']:.2f} [ours {min(rounds['edgetune']):.0f}-{max(rounds['edgetune']):.0f},"
          f" torch {min(rounds['torch']):.0f}-{max(rounds['torch']):.0f} us]; fastest call {best['edgetune']:.0f} vs "
          f"{best['torch']:.0f} us ({entry['speedup_vs_torch_best']:.2f})", flush=True)
    return entry


if __name__ == "__main__":
    raise SystemExit(main())
