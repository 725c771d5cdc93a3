"""One record store per device: MetaSchedule's JSON database in a directory of its own.

TVM's database ignores the target when queried, so two devices sharing one store would be handed
each other's schedules; edgetune keeps a directory per target. The JSON files are append-only, so
every committed measurement survives an interrupted build and is the cache of the next one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import tvm_ffi
from tvm.s_tir.meta_schedule.database import JSONDatabase

from edgetune.tuning.tasks import TuningTask

_FAILED_RUN_SECONDS = 1e9  # MetaSchedule records a failed run as 1e10 s


class RecordStore:
    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.database = JSONDatabase(
            path_workload=str(directory / "database_workload.json"),
            path_tuning_record=str(directory / "database_tuning_record.json"),
        )

    def measured_counts(self) -> Counter[int]:
        """Records per workload (structural hash), failed measurements included: they were paid for."""
        return Counter(tvm_ffi.structural_hash(r.workload.mod) for r in self.database.get_all_tuning_records())

    def measured(self, task: TuningTask) -> int:
        return self.measured_counts()[tvm_ffi.structural_hash(task.mod)]

    def best_seconds(self, task: TuningTask) -> float | None:
        """Mean run time of the task's fastest valid record, or None if it has none."""
        if not self.database.has_workload(task.mod):
            return None
        workload = self.database.commit_workload(task.mod)
        for record in self.database.get_top_k(workload, 1):
            seconds = [float(s) for s in record.run_secs]
            mean = sum(seconds) / len(seconds)
            if mean < _FAILED_RUN_SECONDS:
                return mean
        return None

    @property
    def log_path(self) -> Path:
        """One JSON line per measured batch: the tuning curve (best latency against wall time)."""
        return self.directory / "tuning_log.jsonl"

    def log_batch(self, entry: dict[str, Any]) -> None:
        with self.log_path.open("a") as stream:
            stream.write(json.dumps(entry, sort_keys=True) + "\n")

    def read_log(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def files(self) -> list[Path]:
        return [self.directory / "database_workload.json", self.directory / "database_tuning_record.json"]
