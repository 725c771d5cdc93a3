"""Transfer between sibling devices: tuning from scratch vs warm-started from a sibling's records.

    python benchmarks/transfer.py --workloads C2,C6,C9,C12 --trials 128 --seeds 3 --json out.json

Two real sibling devices on this machine: the source is this CPU restricted to one core (a
subprocess under `taskset -c 0` with TVM_NUM_THREADS=1, so edgetune's host detection gives it
num-cores=1 and its kernels run on one thread); the target is this CPU with both cores. For each
workload (conv2d/gemm entries of ../shared/workloads.yaml) the source is tuned once, then for each
seed the target is tuned three times with the same trial budget, search, batch size and seed,
through edgetune's own `tune()` (the code path of `edgetune build`):
- scratch: no siblings;
- warm: the source's best schedules measured first and a ranker trained on its records, refit
  on pooled source + target data ("warm start alone");
- momentum: the same warm start, adapted with momentum (tuning.transfer: momentum, the default).
The order of the three rotates with the seed. Transfer runs' wall time includes reading the
sibling's records (replay + features + training the prior).

Figures: time_to_quality_speedup = scratch's wall time to its final best / the transfer run's
wall time to reach that latency (a run that never reaches it counts min(1, scratch time / its
total time), so a failure is never a win); final_latency_ratio = transfer's final best /
scratch's; first_batch_ratio = best of transfer's first batch / best of scratch's first batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from search_efficiency import DEFAULT_WORKLOADS, build_workload, geomean, load_workloads

SYSTEMS = ("scratch", "warm", "momentum")
FAILURE_RULE = "not reached: counts as min(1, scratch time to its best / the run's total time)"


def make_task(name: str, shape: dict[str, int]):
    from tvm.s_tir.analysis import estimate_tir_flops

    from edgetune.tuning.tasks import TuningTask

    mod = build_workload(name, shape)
    return TuningTask(name, mod, 1, float(estimate_tir_flops(mod)))


def tune_run(task, store_dir: Path, trials: int, search: str, seed: int,
             siblings: dict[str, Path] | None = None, mode: str = "momentum") -> dict[str, Any]:
    """One tuning run of `task` on this process's CPU set, from an empty store; its best-latency curve."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  (paid before timing: a one-time import of 10 s or more)

    from edgetune.profiles import load_profile
    from edgetune.tuning.database.store import RecordStore
    from edgetune.tuning.transfer.siblings import load_sibling_records
    from edgetune.tuning.tune import TuningPlan, tune

    profile = load_profile("host")
    target = profile.tvm_target()
    cores = profile.hardware.cores or 1
    started = time.monotonic()
    loaded = None
    if siblings:
        loaded = load_sibling_records(siblings, [task], target, cores)
    load_s = time.monotonic() - started
    plan = TuningPlan(trials, None, search, seed, cores, profile.hardware, profile.device, profile.isa,
                      siblings=loaded, transfer=mode)
    store = RecordStore(store_dir)
    result = tune([task], target, store, plan, logs_dir=store_dir / "logs")
    curve = [(load_s + entry["elapsed_s"], entry["best_us"], entry["batch_best_us"]) for entry in store.read_log()]
    return {
        "cores": cores,
        "target": str(target),
        "load_siblings_s": load_s,
        "total_s": load_s + result.wall_s,
        "curve": curve,
        "final_us": curve[-1][1] if curve else math.inf,
        "first_batch_us": curve[0][2] if curve else math.inf,
        "transfer": None if result.transfer is None else {
            "seeds_measured": result.transfer.seeds_measured,
            "sibling_records": result.transfer.sibling_records,
            "guard_fell_back": sorted(result.transfer.distrusted),
        },
    }


def time_to(curve: list, latency_us: float) -> float | None:
    for wall, best, _ in curve:
        if best is not None and best <= latency_us:
            return wall
    return None


def tune_source(name: str, shape: dict[str, int], directory: Path, trials: int, search: str) -> dict[str, Any]:
    """The source sibling: this CPU with one core, in a subprocess pinned to core 0."""
    env = dict(os.environ, TVM_NUM_THREADS="1")
    command = ["taskset", "-c", "0", sys.executable, __file__, "--source-only", name, "--trials", str(trials),
               "--search", search, "--store", str(directory)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"tuning the source sibling failed:\n{run.stdout}\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def compare(scratch: dict, run: dict) -> dict[str, Any]:
    reference = time_to(scratch["curve"], scratch["final_us"])
    reached = time_to(run["curve"], scratch["final_us"])
    speedup = reference / reached if reached else min(1.0, reference / run["total_s"])
    return {
        "time_to_quality_speedup": speedup,
        "reached": reached is not None,
        "scratch_time_to_best_s": reference,
        "time_to_scratch_best_s": reached,
        "final_latency_ratio": run["final_us"] / scratch["final_us"],
        "first_batch_ratio": run["first_batch_us"] / scratch["first_batch_us"],
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"geomean": geomean(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="C2,C6,C9,C12")
    parser.add_argument("--workloads-file", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--trials", type=int, default=128, help="trials per run, source and target alike")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--search", choices=("draft-verify", "evolutionary"), default="draft-verify")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--source-only", metavar="WORKLOAD", help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.source_only:
        shape = load_workloads(args.workloads_file, [args.source_only])[args.source_only]
        run = tune_run(make_task(args.source_only, shape), args.store, args.trials, args.search, 0)
        print(json.dumps({k: v for k, v in run.items() if k != "curve"}))
        return 0

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    workloads = load_workloads(args.workloads_file, names)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": platform.processor() or platform.machine(),
        "source": "this CPU, one core (taskset -c 0, TVM_NUM_THREADS=1)",
        "target": "this CPU, all cores",
        "trials": args.trials, "seeds": args.seeds, "search": args.search,
        "failure_rule": FAILURE_RULE,
        "workloads": {},
    }
    overall: dict[str, list[float]] = {"warm": [], "momentum": []}
    with tempfile.TemporaryDirectory() as scratch_dir:
        for name, shape in workloads.items():
            summary = _transfer_workload(name, shape, Path(scratch_dir), args)
            for system in ("warm", "momentum"):
                overall[system] += [s[system]["time_to_quality_speedup"] for s in summary["seeds"]]
            report["workloads"][name] = summary
    report["geomean_time_to_quality_speedup"] = geomean(overall["momentum"])
    report["ablation"] = {"warm_start_only": geomean(overall["warm"]),
                          "warm_start_and_momentum": geomean(overall["momentum"])}
    print(f"\ngeomean time-to-quality speedup over scratch: warm start + momentum "
          f"{report['geomean_time_to_quality_speedup']:.2f} (target >= 5), warm start alone "
          f"{report['ablation']['warm_start_only']:.2f}; {FAILURE_RULE}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0



def _transfer_workload(name: str, shape: dict[str, int], root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One workload: its source tuned on one core, then for each seed the target tuned from scratch, with warm
    start and with momentum, in a rotating order; the speedups printed and returned with their spread."""
    source = tune_source(name, shape, root / f"{name}-source", args.trials, args.search)
    print(f"{name}: source (1 core) best {source['final_us']:.0f} us after {source['total_s']:.0f} s", flush=True)
    task = make_task(name, shape)
    seeds = []
    for seed in range(args.seeds):
        order = SYSTEMS[seed % 3:] + SYSTEMS[: seed % 3]
        runs = {}
        for system in order:
            siblings = None if system == "scratch" else {"source": root / f"{name}-source"}
            runs[system] = tune_run(task, root / f"{name}-{seed}-{system}", args.trials, args.search, seed,
                                    siblings, system if system != "scratch" else "momentum")
        result = {"seed": seed, "runs": runs}
        for system in ("warm", "momentum"):
            result[system] = compare(runs["scratch"], runs[system])
        seeds.append(result)
        print(f"{name} seed {seed}: scratch {runs['scratch']['final_us']:.0f} us at "
              f"{result['momentum']['scratch_time_to_best_s']:.0f} s; "
              + "; ".join(f"{s} {runs[s]['final_us']:.0f} us, speedup {result[s]['time_to_quality_speedup']:.2f}"
                          f" (first batch x{result[s]['first_batch_ratio']:.2f})" for s in ("warm", "momentum")),
              flush=True)
    summary: dict[str, Any] = {"shape": shape, "source": source, "seeds": seeds}
    for system in ("warm", "momentum"):
        speedups = [s[system]["time_to_quality_speedup"] for s in seeds]
        summary[system] = {
            "time_to_quality_speedup": spread(speedups),
            "final_latency_ratio": spread([s[system]["final_latency_ratio"] for s in seeds]),
            "first_batch_ratio": spread([s[system]["first_batch_ratio"] for s in seeds]),
            "failures": sum(not s[system]["reached"] for s in seeds),
        }
    print(f"{name}: speedup " + ", ".join(
        f"{system} {summary[system]['time_to_quality_speedup']['geomean']:.2f} "
        f"[{summary[system]['time_to_quality_speedup']['min']:.2f}, "
        f"{summary[system]['time_to_quality_speedup']['max']:.2f}]" for system in ("warm", "momentum")), flush=True)
    return summary

if __name__ == "__main__":
    raise SystemExit(main())
