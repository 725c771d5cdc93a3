"""Tuning tasks: the fused kernels of a model, heaviest first, so a budget goes where the time is."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.s_tir.meta_schedule.relax_integration import extract_tasks as ms_extract_tasks


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
    """Tasks of a fused Relax module, sorted by total FLOPs (then name, for determinism)."""
    tasks = []
    for extracted in ms_extract_tasks(fused_mod, target):
        mod = extracted.dispatched[0]
        try:
            flops = float(estimate_tir_flops(mod))
        except tvm.TVMError:
            flops = 0.0
        tasks.append(TuningTask(extracted.task_name, mod, int(extracted.weight), flops))
    return sorted(tasks, key=lambda t: (-t.total_flops, t.name))
