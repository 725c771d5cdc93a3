"""Time to quality on a whole model: evolutionary, draft-verify, and draft-verify with a sibling's records.

    python benchmarks/time_to_quality.py --model resnet18 --budget-min 5 --seeds 1 2 3
    python benchmarks/time_to_quality.py --model mobilenet_v2 --budget-min 10 --seeds 1 2 --json out.json

Three systems build the zoo model for this machine (host profile, 2 cores) under the same time budget,
each from its own fresh record store, one seed after another, their order rotating with the seed:
- evolutionary: MetaSchedule's evolutionary search (`search: evolutionary`);
- draft-verify: the analyzer drafts, the learned model verifies (`search: draft-verify`);
- draft-verify+sibling: the same, with a sibling's records to transfer from (`transfer: momentum`). The
  sibling is this CPU as a 1-core device (`overrides: {hardware: {cores: 1}}`: another core count, so
  its own store and target string), tuned once before the seeds with draft-verify for
  `--sibling-budget-min` (default: twice the budget; a fleet's sibling holds the records of earlier
  releases). Each seed gets a fresh copy of that store. `--sibling-records DIR` keeps the sibling's store
  there, or reuses the one an earlier run kept there.
Each build is the `edgetune build` command, in a process of its own. From its summary come the
time to beat ONNX Runtime (`time_to_beat_reference_s`, seconds of tuning) and the tuning curve (the
model's latency along the tuning, estimated from the kernels' best times and anchored on the final
timing), read at 5, 10, 15 and 60 minutes where the budget reaches them. Then, on the idle machine, all
artifacts and ONNX Runtime are timed interleaved, each artifact with its threads waiting as it ships them
(busy_machine.time_artifacts, a process per way): the final latencies compared, each with ONNX Runtime's
round by round in its own process, so its `ort_ms` is ONNX Runtime's time at the artifact's rounds' speed
(its final time times that ratio; the processes run minutes apart, in different spells of a VM).

Each build's own time to beat compares its curve with the ONNX Runtime time that build measured, in its
own window of this machine: one build may meet ONNX Runtime in a slow spell (seen: 37.95 ms against 22.85
interleaved) and another in a fast one, and the time to beat then says where the reference fell, not how
fast the search was. So every curve is also read against one line: scaled to end at the artifact's
interleaved time (the build's own final timing against the interleaved one: the window's speed), and
compared with that ONNX Runtime time. That reading ("one line") gives the ratios.

Printed: per build, time to beat (its own build's and on the one line), the curve's latency at each
checkpoint (scaled), final latency vs ONNX Runtime, trials; per system, the median and range over seeds;
and the ratios of the median times to beat on the one line, evolutionary / draft-verify and draft-verify /
draft-verify+sibling. A build that never beat ONNX Runtime counts as its whole tuning time, so its ratio is
a lower bound (marked '>='). `--reprint JSON` prints the tables again from an earlier run's `--json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_machine import time_artifacts  # noqa: E402  (through e2e: sets the thread counts first)

SYSTEMS = ("evolutionary", "draft-verify", "draft-verify+sibling")
CHECKPOINTS_MIN = (5, 10, 15, 60)
RECIPE_NAME = "time-to-quality"


def recipe(model: str, budget_min: float, search: str, seed: int, transfer: bool, output: Path) -> dict[str, Any]:
    """The host and its 1-core sibling; the host transfers from the sibling only when `transfer`."""
    return {
        "name": RECIPE_NAME,
        "model": {"zoo": model},
        "fleet": [
            {"name": "sibling", "profile": "host", "overrides": {"hardware": {"cores": 1}}, "connection": "local"},
            {"name": "host", "profile": "host", "overrides": {"hardware": {"cores": 2}}, "connection": "local",
             "transfer_from": ["sibling"] if transfer else []},
        ],
        "tuning": {"trials_per_task": 100_000, "time_budget_min": budget_min, "search": search, "seed": seed,
                   "transfer": "momentum" if transfer else "off"},
        "output": str(output),
    }


def build(spec: dict[str, Any], target: str, records_dir: Path, checkout: Path | None = None) -> dict[str, Any]:
    """One target of the recipe, built by the `edgetune` command in a process of its own (TVM's thread pool
    keeps the width it started with: a 1-core sibling would narrow every later build); its summary.
    `checkout`: a source tree of edgetune to build with instead of the installed one."""
    run_dir = Path(spec["output"]).parent
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_path, summary_path = run_dir / "recipe.yaml", run_dir / "summary.json"
    recipe_path.write_text(json.dumps(spec))  # JSON is YAML: names go in as data
    command = [sys.executable, "-m", "edgetune", "build", str(recipe_path), "--target", target,
               "--records-dir", str(records_dir), "--json", str(summary_path)]
    started = time.monotonic()
    env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    # run outside any source tree: `python -m` puts the working directory first on the import path
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=run_dir)
    wall_s = time.monotonic() - started
    if finished.returncode != 0 or not summary_path.exists():
        raise SystemExit(f"edgetune build failed ({finished.returncode}):\n{finished.stdout[-3000:]}{finished.stderr[-3000:]}")
    echo_said(finished.stdout, ("tuning ended by", "one compile and run", "the artifact's threads"))
    summary = json.loads(summary_path.read_text())["targets"][target]
    summary["build_wall_s"] = wall_s
    return summary


def echo_said(output: str, sayings: tuple[str, ...]) -> None:
    """The build's messages that hold one of `sayings`, whole: the console wraps a long message onto lines of
    its own, which do not start with the target's "[name]"."""
    echoing = False
    for line in output.splitlines():
        if line.startswith("[") or not line.strip():
            echoing = any(said in line for said in sayings)
        if echoing:
            print(f"    {line.strip()}", flush=True)


def latency_at(curve: list[list[float]], seconds: float) -> float | None:
    """The curve's model latency (ms) at `seconds` of tuning: its last point no later (None: none yet)."""
    points = [ms for at, ms in curve if at <= seconds]
    return points[-1] if points else None


def on_one_line(row: dict[str, Any]) -> tuple[list[list[float]], float | None]:
    """The build's curve scaled to end at its artifact's interleaved time, and the first second at which it
    runs below the interleaved ONNX Runtime time (None: never in its tuning)."""
    scale = row["final_ms"] / row["latency_ms"] if row.get("latency_ms") else 1.0
    curve = [[at, ms * scale] for at, ms in row["tuning_curve"]]
    return curve, next((at for at, ms in curve if ms < row["ort_ms"]), None)


def run_seeds(args: argparse.Namespace, scratch: Path) -> list[dict[str, Any]]:
    """The sibling once, then every system for every seed (order rotating); one row per build."""
    sibling_records = args.sibling_records or scratch / "sibling-records"
    if "draft-verify+sibling" in args.systems and any(sibling_records.glob("sibling-*/database_tuning_record.json")):
        print(f"sibling: the records kept in {sibling_records}", flush=True)
    elif "draft-verify+sibling" in args.systems:
        sibling_min = args.sibling_budget_min or 2 * args.budget_min
        print(f"sibling: {args.model} as a 1-core device, draft-verify, {sibling_min} min", flush=True)
        sibling = build(recipe(args.model, sibling_min, "draft-verify", 0, False, scratch / "sibling-out"),
                        "sibling", sibling_records)
        print(f"    the sibling's artifact: {sibling['latency_ms']:.2f} ms on its 1 core; "
              f"{sibling['trials_measured']} trials", flush=True)
    rows = []
    systems = [s for s in SYSTEMS if s in args.systems]
    for turn, seed in enumerate(args.seeds):
        shift = turn % len(systems)
        for system in systems[shift:] + systems[:shift]:
            run_dir = scratch / f"{system}-{seed}"
            records = run_dir / "records"
            if system.endswith("+sibling"):
                shutil.copytree(sibling_records, records)
            search = "evolutionary" if system == "evolutionary" else "draft-verify"
            print(f"seed {seed}: {system}", flush=True)
            spec = recipe(args.model, args.budget_min, search, seed, system.endswith("+sibling"), run_dir / "out")
            rows.append({"system": system, "seed": seed, **build(spec, "host", records)})
            done = rows[-1]
            print(f"    built: {done['latency_ms']:.2f} ms against ONNX Runtime's {done['reference_latency_ms']:.2f} ms "
                  f"in the build's own timing; beat it after {done['time_to_beat_reference_s']} s of tuning; "
                  f"{done['trials_measured']} trials", flush=True)
            if done.get("transfer"):
                print(f"    transfer: {done['transfer'].get('seeds_measured')} sibling schedules measured first; "
                      f"{len(done['transfer'].get('tasks_best_from_sibling') or [])} tasks still best with one",
                      flush=True)
    return rows


def ratio_text(slow: list[float | None], fast: list[float | None], budgets: tuple[list[float], list[float]]) -> str:
    """Median time to beat of `slow` / of `fast`. A build that never beat counts its whole tuning time, a
    floor of its true time: on the slow side the ratio is then a lower bound, on the fast side an upper one."""
    slow_s = float(np.median([t if t is not None else s for t, s in zip(slow, budgets[0])]))
    fast_s = float(np.median([t if t is not None else s for t, s in zip(fast, budgets[1])]))
    if fast_s <= 0:
        return "n/a"
    mark = {(False, False): "", (True, False): ">= ", (False, True): "<= ", (True, True): "unknown: "}[
        (None in slow, None in fast)]
    return f"{mark}{slow_s / fast_s:.2f}x"


def print_tables(rows: list[dict[str, Any]], budget_min: float) -> dict[str, Any]:
    checkpoints = [c for c in CHECKPOINTS_MIN if c <= budget_min]
    ort = float(np.median([r["ort_ms"] for r in rows]))
    header = ("system                seed  own ORT  beat own  one line  beat line"
              + "".join(f"  ms@{c:>2}min" for c in checkpoints))
    print(f"\n{header}  final ms  vs ORT  trials  tuning s  build s")
    for r in rows:
        curve, r["time_to_beat_one_line_s"] = on_one_line(r)
        own_beat, line_beat = (f"{b:.0f} s" if b is not None else "never"
                               for b in (r["time_to_beat_reference_s"], r["time_to_beat_one_line_s"]))
        own_and_line = f"{r['reference_latency_ms']:7.2f}  {own_beat:>8s}  {r['ort_ms']:8.2f}  {line_beat:>9s}"
        at = "".join(f"  {v:8.2f}" if (v := latency_at(curve, c * 60)) is not None else "         -"
                     for c in checkpoints)
        print(f"{r['system']:21s} {r['seed']:4d}  {own_and_line}{at}  {r['final_ms']:8.2f}"
              f"  {r['ort_ms'] / r['final_ms']:5.2f}x  {r['trials_measured']:6d}  {r['tuning_s']:8.0f}"
              f"  {r['build_wall_s']:7.0f}")
    print(f"\nONNX Runtime, interleaved with the artifacts: {ort:.2f} ms (median over the builds, each at its "
          "artifact's rounds' speed); 'own': each build's own timing of it")
    print("system                time to beat ORT, one line (median, range)   final vs ORT (median, range)")
    per_system: dict[str, Any] = {}
    for system in (s for s in SYSTEMS if any(r["system"] == s for r in rows)):
        mine = [r for r in rows if r["system"] == system]
        beats = [r["time_to_beat_one_line_s"] for r in mine]
        reached = [b for b in beats if b is not None]
        speed = [r["ort_ms"] / r["final_ms"] for r in mine]
        per_system[system] = {"time_to_beat_s": beats, "vs_ort": speed, "tuning_s": [r["tuning_s"] for r in mine]}
        beat_text = (f"{np.median(reached):.0f} s ({min(reached):.0f}-{max(reached):.0f}), "
                     f"{len(reached)}/{len(beats)} beat it" if reached else f"never (0/{len(beats)})")
        print(f"{system:21s} {beat_text:44s} {np.median(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f})")
    pairs = (("evolutionary", "draft-verify"), ("draft-verify", "draft-verify+sibling"))
    ratios = {}
    for slow, fast in (p for p in pairs if p[0] in per_system and p[1] in per_system):
        text = ratio_text(per_system[slow]["time_to_beat_s"], per_system[fast]["time_to_beat_s"],
                          (per_system[slow]["tuning_s"], per_system[fast]["tuning_s"]))
        ratios[f"{slow} / {fast}"] = text
        print(f"time to beat ORT on one line, {slow} / {fast}: {text}")
    return {"per_system": per_system, "time_to_beat_ratios": ratios, "onnxruntime_ms": ort}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("resnet18", "mobilenet_v2"), default="resnet18")
    parser.add_argument("--budget-min", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sibling-budget-min", type=float, help="the sibling's budget (default: twice --budget-min)")
    parser.add_argument("--sibling-records", type=Path,
                        help="the sibling's record store: tuned into this folder when it holds none, else reused "
                             "(a sibling tuned by an earlier run: its build takes --sibling-budget-min)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds of the artifacts")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="which of the three to build (the sibling is tuned only for the third)")
    parser.add_argument("--json", type=Path, help="write every build's figures here")
    parser.add_argument("--reprint", type=Path, help="build nothing: print the tables of an earlier run's --json")
    parser.add_argument("--ort-ms", type=float,
                        help="with --reprint: the ONNX Runtime time to read every build against instead of the "
                             "recorded median (its fast rounds, where slow ones spoiled the median)")
    args = parser.parse_args()
    if args.reprint:
        earlier = json.loads(args.reprint.read_text())
        print(f"{earlier['model']}, {earlier['budget_min']} min budget, as {args.reprint} recorded it")
        for row in earlier["builds"]:
            row["ort_ms"] = args.ort_ms or row["ort_ms"]
        print_tables(earlier["builds"], earlier["budget_min"])
        return 0
    if importlib.util.find_spec("edgetune") is None:  # the artifacts are timed in this process, after the builds
        raise SystemExit("edgetune is not installed for this Python: pip install -e . first")
    with tempfile.TemporaryDirectory(prefix="edgetune-ttq-") as scratch:
        rows = run_seeds(args, Path(scratch))
        libraries = {f"{r['system']}-{r['seed']}": Path(r["artifact_dir"]) / "model.so" for r in rows}
        print("timing every artifact and ONNX Runtime, interleaved", flush=True)
        times = time_artifacts({"zoo": args.model}, libraries, args.repeats)
    for r in rows:
        name = f"{r['system']}-{r['seed']}"
        # ONNX Runtime at the artifact's rounds' speed: the artifacts' timing processes ran minutes apart
        r["final_ms"] = times.ms(name)
        r["ort_ms"] = r["final_ms"] * times.vs_reference(name)
    print(f"\n{args.model}, {args.budget_min} min budget, seeds {args.seeds}, this machine's 2 cores")
    figures = print_tables(rows, args.budget_min)
    if args.json:
        keep = ("system", "seed", "time_to_beat_reference_s", "time_to_beat_one_line_s", "tuning_curve", "final_ms",
                "ort_ms", "latency_ms", "reference_latency_ms", "trials_measured", "tuning_s", "build_wall_s",
                "tuning_stopped_by")
        args.json.write_text(json.dumps({"model": args.model, "budget_min": args.budget_min, **figures,
                                         "builds": [{k: r.get(k) for k in keep} for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
