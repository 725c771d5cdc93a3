"""One record store per device: MetaSchedule's JSON database in a directory of its own.

TVM's database ignores the target when queried, so two devices sharing one store would be handed
each other's schedules; edgetune keeps a directory per target. The JSON files are append-only, so
every committed measurement survives an interrupted build and is the cache of the next one.
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm_ffi
from tvm.s_tir.meta_schedule.database import Database, JSONDatabase, TuningRecord

from edgetune.errors import InputError
from edgetune.tuning.cost_model import FAILED, mean_seconds
from edgetune.tuning.tasks import MODULE_EQUALITY, TuningTask


class RecordStore:
    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.database = JSONDatabase(
            path_workload=str(directory / "database_workload.json"),
            path_tuning_record=str(directory / "database_tuning_record.json"),
            module_equality=MODULE_EQUALITY,
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
            mean = mean_seconds(record.run_secs)
            if mean < FAILED:
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


EXPORT_FORMAT = "edgetune-records/1"
_INDEX = "index.json"
_CARRIED = ("database_workload.json", "database_tuning_record.json", "cost_model.npz", "tuning_log.jsonl")


def export_stores(stores: dict[str, Path], archive: Path) -> dict[str, int]:
    """Write the stores (directory name -> directory) into one reproducible .tar.gz; records per store."""
    from edgetune.archive import archive_directory

    counts = {}
    with tempfile.TemporaryDirectory() as scratch:
        stage = Path(scratch) / "edgetune-records"
        for name, directory in sorted(stores.items()):
            (stage / name).mkdir(parents=True)
            for file in _CARRIED:
                if (directory / file).is_file():
                    shutil.copyfile(directory / file, stage / name / file)
            counts[name] = len(RecordStore(stage / name).database)
        (stage / _INDEX).write_text(json.dumps({"format": EXPORT_FORMAT, "stores": counts}, indent=2, sort_keys=True))
        archive.parent.mkdir(parents=True, exist_ok=True)
        archive_directory(stage, archive)
    return counts


@dataclass
class ImportedStore:
    name: str
    added: int  # records new to the local store
    present: int  # records it already held


def import_stores(archive: Path, records_dir: Path) -> list[ImportedStore]:
    """Merge every store of an exported archive into the store of the same name under `records_dir`.

    Nothing local is removed or replaced: records are added unless the store holds the same one
    (same workload, trace, run times, target), tuning-log lines likewise, and the learned model's
    training data is merged and the model refit.
    """
    from edgetune.tuning.cost_model import RankingCostModel

    with tempfile.TemporaryDirectory() as scratch:
        root = _unpack(archive, Path(scratch))
        index = json.loads((root / _INDEX).read_text())
        imported = []
        for name in sorted(index["stores"]):
            source_dir = root / name
            if not _STORE_NAME.fullmatch(name) or not (source_dir / "database_tuning_record.json").is_file():
                raise InputError(f"{archive}: store '{name}' listed in {_INDEX} has no records in the archive")
            try:
                source = RecordStore(source_dir)
            except Exception as exc:  # TVM's JSON reader: the file is damaged
                raise InputError(f"{archive}: store '{name}' cannot be read: {exc}") from exc
            target = RecordStore(records_dir / name)
            known = {_record_key(r) for r in target.database.get_all_tuning_records()}
            added = 0
            for record in source.database.get_all_tuning_records():
                if _record_key(record) in known:
                    continue
                commit_record(target.database, record)
                known.add(_record_key(record))
                added += 1
            if source.log_path.is_file():
                known_lines = set(target.log_path.read_text().splitlines()) if target.log_path.is_file() else set()
                new = [line for line in source.log_path.read_text().splitlines() if line not in known_lines]
                with target.log_path.open("a") as stream:
                    stream.writelines(line + "\n" for line in new)
            if (source_dir / "cost_model.npz").is_file():
                model = RankingCostModel(path=target.directory / "cost_model.npz")
                model.merge(RankingCostModel(path=source_dir / "cost_model.npz"))
            imported.append(ImportedStore(name, added, len(source.database) - added))
    return imported


_STORE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def commit_record(database: Database, record: TuningRecord) -> None:
    """`record` into `database`, under the database's own copy of its workload (another database's
    workload object is not one it can look up)."""
    workload = database.commit_workload(record.workload.mod)
    database.commit_tuning_record(TuningRecord(record.trace, workload, record.run_secs, record.target,
                                               record.args_info))


def _record_key(record: TuningRecord) -> tuple[int, str, tuple[float, ...], str]:
    """Same workload, schedule, run times and target: the same measurement."""
    return (tvm_ffi.structural_hash(record.workload.mod), str(record.trace.as_json()),
            tuple(float(s) for s in record.run_secs or []), str(record.target))


def _unpack(archive: Path, into: Path) -> Path:
    """The archive's top directory, extracted with tarfile's safe 'data' filter; InputError when it
    is not an export of `edgetune records export`."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(into, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise InputError(f"{archive}: not a records archive from `edgetune records export` ({exc})") from exc
    root = into / "edgetune-records"
    try:
        index = json.loads((root / _INDEX).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{archive}: no readable edgetune-records/{_INDEX} ({exc})") from exc
    if not isinstance(index, dict) or index.get("format") != EXPORT_FORMAT or not isinstance(index.get("stores"), dict):
        raise InputError(f"{archive}: {_INDEX} is not format {EXPORT_FORMAT!r}")
    return root
