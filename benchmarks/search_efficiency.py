"""Search efficiency: TVM's stock search vs edgetune's draft-then-verify, side by side.

    python benchmarks/search_efficiency.py --workloads C2,C6,C9,C12 --trials 128 --seeds 3 --json out.json

For every workload (conv2d and gemm entries of ../shared/workloads.yaml) and seed, tunes the
same kernel twice on this machine with the same trial budget, batch size, builder (edgetune's
fast builder), runner and seed: once with MetaSchedule's EvolutionarySearch + XGBModel, once
with DraftVerifySearch + RankingCostModel, and records each run's best latency against wall
time (search + build + measure, from the start of `tune_tasks`). The two systems alternate
which goes first from seed to seed, so slow drifts of a shared machine hit both.

Figures (per workload, and geometric means over workloads and seeds):
- time_to_quality_speedup = stock's time to reach its own final best latency / ours to reach
  that latency. Rule when ours never reaches it: the run is reported as a failure and counts as
  min(1, stock's time to its best / our total time), so a failure can never count as a win.
- final_latency_ratio = our final best latency / stock's.
- draft_cost_ratio = learned-model cost per candidate (PerStoreFeature + XGBoost prediction
  on materialized candidates) / draft-model cost per candidate (the analyzer over decision
  vectors), both measured in this run on the workload's design spaces.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOADS = REPO.parent / "shared" / "workloads.yaml"
FAILURE_RULE = "not reached: counts as min(1, stock time to its best / our total time)"


@dataclass
class Run:
    system: str
    seed: int
    curve: list[tuple[float, float]] = field(default_factory=list)  # (wall seconds, best seconds so far)
    total_s: float = 0.0
    trials: int = 0

    @property
    def final(self) -> float:
        return self.curve[-1][1] if self.curve else math.inf

    def time_to(self, latency: float) -> float | None:
        """Wall time of the first batch whose best-so-far is at most `latency`."""
        for wall, best in self.curve:
            if best <= latency:
                return wall
        return None


def load_workloads(path: Path, names: list[str]) -> dict[str, dict[str, int]]:
    spec = yaml.safe_load(path.read_text())
    table = {}
    for group in spec.values():
        table.update(group)
    missing = [n for n in names if n not in table]
    if missing:
        raise SystemExit(f"unknown workloads {missing}; {path} has {sorted(table)}")
    return {n: table[n] for n in names}


def build_workload(name: str, shape: dict[str, int], layout: str = "NCHW", winograd_tile: int | None = None):
    """The kernel as a TIR module: fp32 conv2d (padding K//2; NCHW/OIHW or NHWC/HWIO) or an fp32 matmul.

    `winograd_tile` m: a 3x3 stride-1 NHWC conv2d by F(m x m, 3x3) as edgetune compiles it for CPUs
    (edgetune.frontend.winograd), on weights already transformed (edgetune transforms the constant
    weights at compile time).
    """
    import tvm
    from tvm import te, topi

    if {"M", "N", "K"} <= shape.keys():
        a = te.placeholder((shape["M"], shape["K"]), name="A")
        b = te.placeholder((shape["K"], shape["N"]), name="B")
        k = te.reduce_axis((0, shape["K"]), name="k")
        c = te.compute((shape["M"], shape["N"]), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
        return tvm.IRModule({"main": te.create_prim_func([a, b, c])})
    if winograd_tile and layout == "NHWC" and shape["K"] == 3 and shape["S"] == 1:
        from edgetune.frontend.winograd import winograd_conv2d_nhwc

        alpha = winograd_tile + 2
        data = te.placeholder((1, shape["H"], shape["W"], shape["IC"]), name="data")
        weight = te.placeholder((alpha, alpha, shape["OC"], shape["IC"]), name="weight")
        out = winograd_conv2d_nhwc(data, weight, 1, "float32")
    elif layout == "NHWC":
        data = te.placeholder((1, shape["H"], shape["W"], shape["IC"]), name="data")
        weight = te.placeholder((shape["K"], shape["K"], shape["IC"], shape["OC"]), name="weight")
        out = topi.nn.conv2d_nhwc(data, weight, shape["S"], shape["K"] // 2, 1)
    else:
        data = te.placeholder((1, shape["IC"], shape["H"], shape["W"]), name="data")
        weight = te.placeholder((shape["OC"], shape["IC"], shape["K"], shape["K"]), name="weight")
        out = topi.nn.conv2d_nchw(data, weight, shape["S"], shape["K"] // 2, 1)
    return tvm.IRModule({"main": te.create_prim_func([data, weight, out])})


def tune_once(system: str, mod, profile, trials: int, per_iter: int, seed: int) -> Run:
    """One tuning run from scratch (fresh database and cost model), with its best-latency curve."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.measure_callback import MeasureCallback, PyMeasureCallback

    from edgetune.tuning.builder import CandidateBuilder
    from edgetune.tuning.local_runner import LocalCandidateRunner
    from edgetune.tuning.cost_model.ranking import RankingCostModel
    from edgetune.tuning.search_strategy.draft_verify import DraftVerifySearch

    cores = profile.hardware.cores or 1
    run = Run(system, seed)
    started = time.monotonic()
    best = math.inf

    @derived_object
    class Timeline(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
            nonlocal best
            for built, ran in zip(builder_results, runner_results):
                if built.error_msg is None and ran.error_msg is None and ran.run_secs:
                    seconds = float(np.mean([float(s) for s in ran.run_secs]))
                    if seconds < 1e9:
                        best = min(best, seconds)
            run.trials += len(measure_candidates)
            run.curve.append((time.monotonic() - started, best))

    if system == "stock":
        strategy = ms.search_strategy.EvolutionarySearch()
        cost_model = ms.cost_model.XGBModel(
            extractor=ms.feature_extractor.PerStoreFeature(), adaptive_training=True, num_tuning_cores=cores
        )
    else:
        strategy = DraftVerifySearch(profile.hardware, profile.device, profile.isa)
        cost_model = RankingCostModel(num_threads=cores)
    context = ms.TuneContext(
        mod=mod,
        target=profile.tvm_target(),
        space_generator="post-order-apply",
        search_strategy=strategy,
        task_name="kernel",
        rand_state=seed + 1,
        num_threads=cores,
    )
    with tempfile.TemporaryDirectory() as work:
        ms.tune_tasks(
            tasks=[context],
            task_weights=[1.0],
            work_dir=work,
            max_trials_global=trials,
            max_trials_per_task=trials,
            num_trials_per_iter=per_iter,
            builder=CandidateBuilder(max_workers=cores),
            runner=LocalCandidateRunner(),
            database=ms.database.MemoryDatabase(),
            cost_model=cost_model,
            measure_callbacks=list(MeasureCallback.create("default")) + [Timeline()],
            task_scheduler="round-robin",
        )
    run.total_s = time.monotonic() - started
    return run


def draft_cost_ratio(mod, profile, seed: int, candidates: int = 96) -> dict[str, float]:
    """Per-candidate cost of the learned model (features + XGBoost) vs the analyzer, measured here."""
    import xgboost as xgb
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

    from edgetune.tuning.analyzer import SpaceModel, make_analyzer
    from edgetune.tuning.cost_model.ranking import RankingCostModel

    target = profile.tvm_target()
    context = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply",
                             search_strategy="evolutionary", num_threads=profile.hardware.cores or 1)
    spaces = context.space_generator.generate_design_space(mod)
    model = SpaceModel.analyze(mod, spaces[0])
    analyzer = make_analyzer(profile.hardware, profile.device, profile.isa)
    rng = np.random.default_rng(seed)
    rows = model.sample(rng, 2048)
    analyzer.latency(model.nests(rows[:64]))  # warm up numpy
    begin = time.perf_counter()
    for _ in range(3):
        analyzer.latency(model.nests(rows))
    draft = (time.perf_counter() - begin) / (3 * len(rows))

    schedules = [s for s in (model.materialize(mod, r, context.space_generator.postprocs, i)
                             for i, r in enumerate(rows[:candidates])) if s is not None]
    measure = [MeasureCandidate(s, ArgInfo.from_entry_func(s.mod, remove_preproc=True)) for s in schedules]
    learned = RankingCostModel(num_threads=profile.hardware.cores or 1)
    features = learned.features(context, measure[:8])
    data = xgb.DMatrix(np.repeat(features, 8, axis=0), label=rng.random(8 * len(features)))
    data.set_group([len(features) * 8])
    learned.booster = xgb.train({"objective": "rank:pairwise", "max_depth": 6, "verbosity": 0}, data, 120)
    begin = time.perf_counter()
    learned.predict(context, measure)
    verify = (time.perf_counter() - begin) / len(measure)
    return {"draft_s_per_candidate": draft, "learned_s_per_candidate": verify, "ratio": verify / draft}


def geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def compare(stock: Run, ours: Run) -> dict[str, Any]:
    target = stock.final
    stock_time = stock.time_to(target)
    assert stock_time is not None
    reached = ours.time_to(target)
    if reached is not None:
        speedup = stock_time / reached
    else:
        speedup = min(1.0, stock_time / ours.total_s)
    return {
        "seed": stock.seed,
        "stock_final_us": stock.final * 1e6,
        "ours_final_us": ours.final * 1e6,
        "stock_time_to_best_s": stock_time,
        "ours_time_to_stock_best_s": reached,
        "reached": reached is not None,
        "time_to_quality_speedup": speedup,
        "final_latency_ratio": ours.final / stock.final,
        "stock": asdict(stock),
        "ours": asdict(ours),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="C2,C6,C9,C12")
    parser.add_argument("--workloads-file", type=Path, default=DEFAULT_WORKLOADS)
    parser.add_argument("--trials", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--per-iter", type=int, default=32, help="candidates measured per batch")
    parser.add_argument("--profile", default="host")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from edgetune.profiles import load_profile

    profile = load_profile(args.profile)
    # The first TuneContext of a process imports tvm.s_tir.tensor_intrin (10 s or more here):
    # pay it before anything is timed, so it falls on neither system.
    import tvm.s_tir.tensor_intrin  # noqa: F401

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    workloads = load_workloads(args.workloads_file, names)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": {"cpu": platform.processor() or platform.machine(), "profile": args.profile,
                    "target": str(profile.tvm_target())},
        "trials": args.trials,
        "seeds": args.seeds,
        "per_iter": args.per_iter,
        "failure_rule": FAILURE_RULE,
        "workloads": {},
    }
    all_speedups, all_ratios, cost_ratios = [], [], []
    for name, shape in workloads.items():
        mod = build_workload(name, shape)
        costs = draft_cost_ratio(mod, profile, seed=0)
        cost_ratios.append(costs["ratio"])
        seeds = []
        for seed in range(args.seeds):
            order = ("stock", "ours") if seed % 2 == 0 else ("ours", "stock")
            runs = {system: tune_once(system, mod, profile, args.trials, args.per_iter, seed) for system in order}
            result = compare(runs["stock"], runs["ours"])
            seeds.append(result)
            print(f"{name} seed {seed}: stock {result['stock_final_us']:.0f} us at {result['stock_time_to_best_s']:.0f} s "
                  f"(total {runs['stock'].total_s:.0f} s); ours {result['ours_final_us']:.0f} us, "
                  + (f"reached stock's best at {result['ours_time_to_stock_best_s']:.0f} s"
                     if result["reached"] else "never reached stock's best")
                  + f" (total {runs['ours'].total_s:.0f} s); speedup {result['time_to_quality_speedup']:.2f}, "
                  f"final ratio {result['final_latency_ratio']:.3f}", flush=True)
        speedups = [s["time_to_quality_speedup"] for s in seeds]
        ratios = [s["final_latency_ratio"] for s in seeds]
        all_speedups += speedups
        all_ratios += ratios
        report["workloads"][name] = {
            "shape": shape,
            "time_to_quality_speedup": {"geomean": geomean(speedups), "min": min(speedups), "max": max(speedups)},
            "final_latency_ratio": {"geomean": geomean(ratios), "min": min(ratios), "max": max(ratios)},
            "failures": sum(not s["reached"] for s in seeds),
            "draft_cost": costs,
            "seeds": seeds,
        }
        print(f"{name}: speedup geomean {geomean(speedups):.2f} [{min(speedups):.2f}, {max(speedups):.2f}], "
              f"final ratio geomean {geomean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}], "
              f"draft cost ratio {costs['ratio']:.0f}x "
              f"({costs['learned_s_per_candidate'] * 1e3:.2f} ms vs {costs['draft_s_per_candidate'] * 1e6:.1f} us)",
              flush=True)
    report["geomean_time_to_quality_speedup"] = geomean(all_speedups)
    report["geomean_final_latency_ratio"] = geomean(all_ratios)
    report["draft_cost_ratio"] = geomean(cost_ratios)
    report["failures"] = sum(w["failures"] for w in report["workloads"].values())
    print(f"\ngeomean over workloads and seeds: time-to-quality speedup {report['geomean_time_to_quality_speedup']:.2f}"
          f" (target >= 3.0), final latency ratio {report['geomean_final_latency_ratio']:.3f} (target <= 1.0), "
          f"draft cost ratio {report['draft_cost_ratio']:.0f} (target >= 20); "
          f"{report['failures']} of {len(all_speedups)} runs never reached stock's best ({FAILURE_RULE})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
