"""How well the draft model (the symbol-based analyzer) ranks what a build measured, task by task, and where it is blind.

    python benchmarks/analyzer_accuracy.py build/host-resnet18/records/host-* [--blind-ratio 1.5] [--tie 0.01]

Every candidate of the record store (a CPU build's) is estimated by the CPU analyzer as draft-verify scores drafts:
its decisions read into the task's design space (TVM's default spaces, read structurally; candidates of spaces the
analyzer does not read, and tasks without decisions, are left out). Printed per task: the candidates measured,
Spearman's rank correlation between estimate and measured time (ties ranked alike), the first candidate measured
(the search's first pick) against the task's best, top/best: the mean of the candidates in the analyzer's best tie
bucket (as draft-verify buckets estimates: what a pick by the analyzer alone gets on average) against the task's
best, and the analyzer's blind pairs: candidates it estimates within `--tie` of each other that ran more than
`--blind-ratio` apart, with the decisions that differ in the worst such pair. A blind pair is what no ranking by
the analyzer can order: which of the two a batch measures is left to the tie-break. Estimates are compared on this
machine's host profile.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: F401  (sets the thread counts first)

from edgetune.tuning.cost_model.ranking import rank  # ties share their mean rank
from edgetune.tuning.measurements import FAILED, mean_seconds
from edgetune.tuning.search_strategy.draft_verify import tie_buckets


@dataclass
class Candidate:
    measured_us: float
    estimate_us: float
    decisions: list


@dataclass
class TaskReport:
    task: str
    candidates: list[Candidate] = field(default_factory=list)

    def spearman(self) -> float | None:
        if len(self.candidates) < 3:
            return None
        measured = rank(np.array([c.measured_us for c in self.candidates]))
        estimated = rank(np.array([c.estimate_us for c in self.candidates]))
        if np.ptp(measured) == 0 or np.ptp(estimated) == 0:
            return None
        return float(np.corrcoef(measured, estimated)[0, 1])

    def top_bucket(self) -> float:
        """Mean measured time, over the task's best, of the candidates in the analyzer's best tie bucket: what a
        pick by the analyzer alone gets on average, as draft-verify buckets estimates (the tie-break decides there)."""
        buckets = tie_buckets([c.estimate_us * 1e-6 for c in self.candidates])
        top = [c.measured_us for c, bucket in zip(self.candidates, buckets) if bucket == buckets.min()]
        return float(np.mean(top)) / min(c.measured_us for c in self.candidates)

    def blind_pairs(self, tie: float, ratio: float) -> list[tuple[Candidate, Candidate]]:
        """(faster, slower) pairs of different decisions estimated within `tie` (relative) that ran more than `ratio`
        apart (the same decisions timed twice apart are the machine's noise, not the analyzer's)."""
        pairs = []
        ordered = sorted(self.candidates, key=lambda c: c.estimate_us)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                if b.estimate_us > a.estimate_us * (1 + tie):
                    break
                fast, slow = sorted((a, b), key=lambda c: c.measured_us)
                if slow.measured_us > ratio * fast.measured_us and fast.decisions != slow.decisions:
                    pairs.append((fast, slow))
        return pairs


def read_store(store: Path) -> dict[int, TaskReport]:
    """Each measured candidate of the store estimated from its decisions, by task (its workload's index in the
    store); tasks in the order first measured, each named as the store's tuning log names it (`task_names`)."""
    from tvm.s_tir import meta_schedule as ms

    from edgetune.profiles import resolve_profile
    from edgetune.tuning.analyzer import make_analyzer
    from edgetune.tuning.intrinsics import register_tensor_intrinsics

    profile = resolve_profile("host", None)
    target = profile.tvm_target()
    register_tensor_intrinsics(target)
    analyzer = make_analyzer(profile.hardware, profile.device, profile.isa)
    workloads = [ms.database.Workload.from_json(json.loads(line))
                 for line in (store / "database_workload.json").read_text().splitlines() if line.strip()]
    lines = [json.loads(line) for line in (store / "database_tuning_record.json").read_text().splitlines()
             if line.strip()]  # in the order measured
    names = task_names(store, list(dict.fromkeys(index for index, _ in lines)))
    spaces: dict[int, list] = {}
    tasks: dict[int, TaskReport] = {}
    for index, record_json in lines:
        record = ms.database.TuningRecord.from_json(record_json, workloads[index])
        seconds = mean_seconds(record.run_secs)
        if seconds == FAILED:
            continue
        if index not in spaces:
            spaces[index] = _space_models(record.workload.mod, target)
        estimate = _estimate(spaces[index], analyzer, record.trace)
        if estimate is None:  # a space the analyzer does not read structurally: not drafted by it
            continue
        task = tasks.setdefault(index, TaskReport(names[index]))
        decisions = [_plain(value) for value in record.trace.decisions.values()]
        task.candidates.append(Candidate(seconds * 1e6, estimate * 1e6, decisions))
    return tasks


def _space_models(mod, target) -> list:
    """The task's design spaces (TVM's defaults, as the tuning generates them) that the analyzer reads structurally."""
    from tvm.s_tir import meta_schedule as ms

    from edgetune.tuning.analyzer import SpaceModel, UnsupportedSpace

    context = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply", num_threads=1)
    models = []
    for space in context.space_generator.generate_design_space(mod):
        try:
            models.append(SpaceModel.analyze(mod, space))
        except UnsupportedSpace:
            continue
    return models


def _estimate(models: list, analyzer, trace) -> float | None:
    """The analyzer's estimate of a measured trace, from its decisions as the drafts are scored; None where no
    structurally read space holds the trace."""
    for model in models:
        row = model.encode(trace)
        if row is not None:
            return float(analyzer.latency(model.nests(row[None, :]))[0])
    return None


def _plain(value):
    """A decision as plain numbers and lists (TVM hands integers and arrays of them)."""
    if isinstance(value, (int, float, str)):
        return value
    try:
        return [_plain(v) for v in value]
    except TypeError:
        return int(value)


def task_names(store: Path, order: list[int]) -> dict[int, str]:
    """Workload index -> task name, from the store's tuning log (`tuning_log.jsonl`: a line per task and batch, in
    the order measured, as the records: its tasks in order of first appearance are the workloads in `order`, those
    of the records' first appearance); "task N" by that order where the log names another number of tasks."""
    logged: list[str] = []
    try:
        for line in (store / "tuning_log.jsonl").read_text().splitlines():
            task = json.loads(line)["task"]
            if task not in logged:
                logged.append(task)
    except (OSError, ValueError, KeyError, TypeError):
        logged = []
    if len(logged) != len(order):
        logged = [f"task {position}" for position in range(len(order))]
    return dict(zip(order, logged))


def report(tasks: dict[int, TaskReport], tie: float, ratio: float) -> None:
    print(f"{'task':<40} {'n':>4} {'spearman':>8} {'first/best':>10} {'top/best':>8} {'best us':>9} {'blind pairs':>11}  "
          "worst blind pair")
    blind_total = 0
    for task in tasks.values():
        best = min(c.measured_us for c in task.candidates)
        first = task.candidates[0].measured_us
        rho = task.spearman()
        pairs = task.blind_pairs(tie, ratio)
        blind_total += len(pairs)
        worst = max(pairs, key=lambda p: p[1].measured_us / p[0].measured_us, default=None)
        described = ""
        if worst is not None:
            fast, slow = worst
            differ = [i for i, (a, b) in enumerate(zip(fast.decisions, slow.decisions)) if a != b]
            described = (f"{fast.measured_us:.0f} vs {slow.measured_us:.0f} us, both estimated "
                         f"{fast.estimate_us:.0f}/{slow.estimate_us:.0f} us; decisions {differ} differ: "
                         + ", ".join(f"{fast.decisions[i]} vs {slow.decisions[i]}" for i in differ[:6]))
        print(f"{task.task[:40]:<40} {len(task.candidates):>4} {('-' if rho is None else f'{rho:.2f}'):>8} "
              f"{first / best:>10.2f} {task.top_bucket():>8.2f} {best:>9.1f} {len(pairs):>11}  {described}")
    print(f"blind pairs in all: {blind_total} (estimates within {tie:.0%}, measured more than {ratio:g}x apart)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="a target's record store directory (<records>/<target>-<digest>)")
    parser.add_argument("--tie", type=float, default=0.01, help="relative distance of estimates counted as equal")
    parser.add_argument("--blind-ratio", type=float, default=1.5, help="measured ratio a blind pair exceeds")
    args = parser.parse_args(argv)
    missing = [name for name in ("database_workload.json", "database_tuning_record.json")
               if not (args.store / name).is_file()]
    if missing:
        parser.error(f"{args.store} is not a record store: no {' or '.join(missing)} in it")
    report(read_store(args.store), args.tie, args.blind_ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
