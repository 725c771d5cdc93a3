"""Tuning tasks: the fused kernels of a model, heaviest first, so a budget goes where the time is."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.s_tir.meta_schedule.database import MemoryDatabase
from tvm.s_tir.meta_schedule.relax_integration import extract_tasks as ms_extract_tasks

MODULE_EQUALITY = "anchor-block"
"""Kernels with the same anchor block (the convolution, the matmul) are one task, whatever their fused
epilogue: ResNet's conv + bias + ReLU and conv + bias + residual add + ReLU are tuned once and the
compiler replays the schedule on both (MetaSchedule's ScheduleUsingAnchorTrace). Tasks extracted with it
and the record stores that hold their schedules must agree on it."""


@dataclass(frozen=True)
class TuningTask:
    name: str
    mod: tvm.IRModule
    weight: int  # how many times the model calls this kernel
    flops: float  # per call

    @property
    def total_flops(self) -> float:
        return self.flops * self.weight


def extract_tasks(fused_mod: tvm.IRModule, target: tvm.target.Target) -> list[TuningTask]:
    """Tasks of a fused Relax module, one per anchor block, sorted by total FLOPs (then name, for
    determinism). A task's weight counts every kernel call that shares its anchor block."""
    anchored = ms_extract_tasks(fused_mod, target, module_equality=MODULE_EQUALITY)
    grouping = MemoryDatabase(module_equality=MODULE_EQUALITY)
    for extracted in anchored:
        grouping.commit_workload(extracted.dispatched[0])
    # TVM's anchor-block extraction over-counts a group whose representative changes (it adds the
    # replaced one's count after incrementing it); the per-kernel counts of the structural extraction
    # are exact, so the weights are summed from those.
    weights: Counter[int] = Counter()
    for kernel in ms_extract_tasks(fused_mod, target):
        weights[tvm_ffi.structural_hash(grouping.commit_workload(kernel.dispatched[0]).mod)] += int(kernel.weight)
    tasks = []
    for extracted in anchored:
        mod = extracted.dispatched[0]
        try:
            flops = float(estimate_tir_flops(mod))
        except tvm.TVMError:
            flops = 0.0
        tasks.append(TuningTask(extracted.task_name, mod, weights[tvm_ffi.structural_hash(mod)], flops))
    return sorted(tasks, key=lambda t: (-t.total_flops, t.name))
