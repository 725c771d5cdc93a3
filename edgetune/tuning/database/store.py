"""One record store per device: MetaSchedule's JSON database in a directory of its own.

TVM's database ignores the target when queried, so two devices sharing one store would be handed
each other's schedules; edgetune keeps a directory per target. The JSON files are append-only, so
every committed measurement survives an interrupted build and is the cache of the next one.

A kill or a full disk can leave a damaged line (a truncated last line, most often), and TVM's
reader then fails on the whole store, naming no file. So every store is scanned in Python first:
damaged lines are reported (file, line) and skipped, TVM reads a cleaned copy, and what a build adds
is still appended to the original files, which are never rewritten in place (`edgetune records
repair` swaps in a cleaned store and keeps the original as a backup).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm_ffi
from tvm.s_tir.meta_schedule.database import Database, JSONDatabase, MemoryDatabase, TuningRecord, Workload

from edgetune.ownership import create_owned
from edgetune.tuning.measurements import FAILED, mean_seconds
from edgetune.tuning.tasks import MODULE_EQUALITY, TuningTask

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
_RECORD_INDEX = re.compile(r"^\[\s*(\d+)\s*,")


@dataclass(frozen=True)
class DamagedLine:
    path: Path
    line: int  # 1-based
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class StoreScan:
    """A store's lines as TVM may read them: damaged ones left out, records renumbered to match."""

    workloads: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)  # workload index = position in `workloads`
    original_index: list[int] = field(default_factory=list)  # kept workload -> its line in the original file
    workload_lines: int = 0  # lines of the original workload file: the index its next line gets
    damaged: list[DamagedLine] = field(default_factory=list)


def scan_store(directory: Path, deep: bool = False) -> StoreScan:
    """Check every line of both JSON files: it parses and has the shape TVM writes; a record's
    workload index names an intact workload line. `deep`: also have TVM parse each line (slower;
    for archives from elsewhere and `records check`)."""
    scan = StoreScan()
    parsed_workloads: dict[int, Workload | None] = {}
    lines = _lines(directory / WORKLOAD_FILE)
    scan.workload_lines = len(lines)
    for number, raw in enumerate(lines):
        value, reason = _parse_workload(raw, deep)
        if reason:
            scan.damaged.append(DamagedLine(directory / WORKLOAD_FILE, number + 1, reason))
            continue
        parsed_workloads[number] = value
        scan.original_index.append(number)
        scan.workloads.append(raw.decode())
    cleaned = {original: position for position, original in enumerate(scan.original_index)}
    for number, raw in enumerate(_lines(directory / RECORD_FILE)):
        record, reason = _parse_record(raw)
        if not reason and record[0] not in cleaned:
            reason = f"refers to workload line {record[0] + 1} of {WORKLOAD_FILE}, which is missing or damaged"
        if not reason and deep:
            reason = _tvm_rejects(lambda: TuningRecord.from_json(record[1], parsed_workloads[record[0]]))
        if reason:
            scan.damaged.append(DamagedLine(directory / RECORD_FILE, number + 1, reason))
            continue
        scan.records.append(_RECORD_INDEX.sub(f"[{cleaned[record[0]]},", raw.decode(), count=1))
    return scan


def _lines(path: Path) -> list[bytes]:
    """The file's lines without their newlines; a last line without one counts (it is the damaged one)."""
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    return lines[:-1] if lines and lines[-1] == b"" else lines


def _parse_workload(raw: bytes, deep: bool) -> tuple[Any, str | None]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not JSON ({'an empty line' if not raw.strip() else exc}); a write was cut short?"
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
            and value[0].isdigit()):
        return None, "expected a workload [\"<structural hash>\", \"<base64 module>\"]"
    try:
        base64.b64decode(value[1], validate=True)
    except binascii.Error:
        return None, "the workload's module is not valid base64"
    if deep:
        workload = None
        reason = _tvm_rejects(lambda: Workload.from_json(value))
        if reason is None:
            workload = Workload.from_json(value)
        return workload, reason
    return None, None


def _parse_record(raw: bytes) -> tuple[Any, str | None]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not JSON ({'an empty line' if not raw.strip() else exc}); a write was cut short?"
    shape_ok = (isinstance(value, list) and len(value) == 2 and type(value[0]) is int and value[0] >= 0
                and isinstance(value[1], list) and len(value[1]) == 4 and isinstance(value[1][0], list)
                and isinstance(value[1][1], (list, type(None))) and isinstance(value[1][2], (dict, type(None)))
                and isinstance(value[1][3], (list, type(None))) and _RECORD_INDEX.match(raw.decode()))
    if not shape_ok:
        return None, "expected a tuning record [<workload index>, [trace, run_secs, target, args_info]]"
    return value, None


def _tvm_rejects(parse) -> str | None:
    try:
        parse()
    except Exception as exc:  # TVM's parsers raise several error types, all meaning "malformed"
        return f"TVM cannot parse it: {str(exc).strip().splitlines()[0][:200]}"
    return None


def end_with_newline(path: Path) -> None:
    """TVM appends a record right after the last byte: after a cut-short line it would glue onto it."""
    if path.is_file() and path.stat().st_size:
        with path.open("rb+") as stream:
            stream.seek(-1, os.SEEK_END)
            if stream.read(1) != b"\n":
                stream.write(b"\n")


def fsync_files(paths: list[Path]) -> None:
    """Flush to the disk what was appended: a batch's records survive a power cut once this returns."""
    for path in paths:
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)


class _CleanedCopy:
    """TVM's database over a cleaned copy of a damaged store; `forward()` appends what it added since
    to the original files, workload indices mapped back to the original's line numbers."""

    def __init__(self, scan: StoreScan, originals: list[Path]):
        self._scratch = tempfile.TemporaryDirectory(prefix="edgetune-store-")
        self.originals = originals
        self.paths = [Path(self._scratch.name) / p.name for p in originals]
        for path, lines in zip(self.paths, (scan.workloads, scan.records)):
            path.write_text("".join(line + "\n" for line in lines))
        self.offsets = [p.stat().st_size for p in self.paths]
        self.to_original = list(scan.original_index)
        self.next_original = scan.workload_lines

    def forward(self) -> None:
        new_workloads, new_records = (self._new_lines(i) for i in range(2))
        for _ in new_workloads:
            self.to_original.append(self.next_original)
            self.next_original += 1
        mapped = [_RECORD_INDEX.sub(lambda m: f"[{self.to_original[int(m.group(1))]},", line, count=1)
                  for line in new_records]
        for original, lines in zip(self.originals, (new_workloads, mapped)):
            if lines:
                with original.open("a") as stream:
                    stream.writelines(line + "\n" for line in lines)

    def _new_lines(self, which: int) -> list[str]:
        with self.paths[which].open("rb") as stream:
            stream.seek(self.offsets[which])
            data = stream.read()
        complete = data[:data.rfind(b"\n") + 1]
        self.offsets[which] += len(complete)
        return complete.decode().splitlines()


class RecordStore:
    """A device's store; damaged lines are skipped (see `damage_warnings`), writes only ever append."""

    def __init__(self, directory: Path):
        create_owned(directory)  # a first store may create <output>/<recipe>/: the build then owns it
        self.directory = directory
        for path in self.files():
            end_with_newline(path)
        scan = scan_store(directory)
        self.damaged = scan.damaged
        self._copy = _CleanedCopy(scan, self.files()) if scan.damaged else None
        workload, record = self._copy.paths if self._copy else self.files()
        self.database = JSONDatabase(path_workload=str(workload), path_tuning_record=str(record),
                                     module_equality=MODULE_EQUALITY)

    def damage_warnings(self) -> list[str]:
        """One line per damaged line skipped, and how to drop them for good."""
        if not self.damaged:
            return []
        return [f"{d}; skipped (the other records are used)" for d in self.damaged] + [
            f"{self.directory}: `edgetune records repair RECIPE` rewrites this store without them (keeping a backup)"]

    def sync(self) -> None:
        """End of a batch: what the database committed reaches the store's own files, on the disk."""
        if self._copy is not None:
            self._copy.forward()
        fsync_files([*self.files(), self.log_path])

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
        """Called at the end of every measured batch: log it, and make the batch's records durable."""
        end_with_newline(self.log_path)
        with self.log_path.open("a") as stream:
            stream.write(json.dumps(entry, sort_keys=True) + "\n")
        self.sync()

    def read_log(self) -> list[dict[str, Any]]:
        """The log's entries; a line cut short by a kill is skipped like a damaged record."""
        if not self.log_path.exists():
            return []
        entries = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(entry, dict):
                entries.append(entry)
        return entries

    def files(self) -> list[Path]:
        return [self.directory / WORKLOAD_FILE, self.directory / RECORD_FILE]


StoredRecords = tuple[Workload, list[list]]
"""A task's workload and some of its records as their JSON values (`RankedStore.best_json`)."""


class RankedStore:
    """A store read for its best records only (a sibling's, for transfer): its lines parsed as JSON, and left for
    the caller to have TVM read the records it uses. TVM's own database replays the trace of every record as it
    opens a store: 6.6 s for a 10-minute ResNet-18 sibling's 561, where the seeds need four per task. Damaged
    lines are skipped, as everywhere."""

    def __init__(self, directory: Path):
        scan = scan_store(directory)
        self._workloads = [Workload.from_json(json.loads(line)) for line in scan.workloads]
        self._equal = MemoryDatabase(module_equality=MODULE_EQUALITY)  # TVM's equality of workloads
        self._committed = [self._equal.commit_workload(w.mod) for w in self._workloads]
        self._ranked: dict[int, list[tuple[float, Any]]] = {}
        for line in scan.records:
            index, record = json.loads(line)
            seconds = mean_seconds(record[1])
            if seconds < FAILED:
                self._ranked.setdefault(index, []).append((seconds, record))
        for records in self._ranked.values():
            records.sort(key=lambda pair: pair[0])

    def best_json(self, task: TuningTask, count: int) -> StoredRecords | None:
        """The task's `count` fastest records that ran, fastest first, as stored and unread by TVM (reading a
        record replays its trace, `TuningRecord.from_json`): the task's workload and the records' JSON values;
        None when the store never measured the task."""
        if not self._equal.has_workload(task.mod):
            return None
        workload = self._equal.commit_workload(task.mod)
        index = next((i for i, w in enumerate(self._committed) if w.same_as(workload)), None)
        if index is None or index not in self._ranked:
            return None
        return self._workloads[index], [record for _, record in self._ranked[index][:count]]


@dataclass
class Repaired:
    directory: Path
    damaged: list[DamagedLine]
    backups: list[Path]


def repair_store(directory: Path) -> Repaired:
    """Swap in a store without its damaged lines; each rewritten file's original is kept as
    `<file>.bak-<n>` (a hard link made before the atomic rename, so no moment lacks either)."""
    scan = scan_store(directory, deep=True)
    backups = []
    if not scan.damaged:
        return Repaired(directory, [], [])
    damaged_files = {d.path.name for d in scan.damaged}
    # a damaged workload line renumbers the records after it, so both files are rewritten then
    rewrite = [WORKLOAD_FILE, RECORD_FILE] if WORKLOAD_FILE in damaged_files else [RECORD_FILE]
    for name in rewrite:
        lines = scan.workloads if name == WORKLOAD_FILE else scan.records
        original = directory / name
        partial = directory / f"{name}.repairing"
        partial.write_text("".join(line + "\n" for line in lines))
        fsync_files([partial])
        backup = _free_backup_name(original)
        os.link(original, backup)
        partial.replace(original)
        backups.append(backup)
    return Repaired(directory, scan.damaged, backups)


def _free_backup_name(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = path.with_name(f"{path.name}.bak-{stamp}"), 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.bak-{stamp}-{n}"), n + 1
    return candidate


def commit_record(database: Database, record: TuningRecord) -> None:
    """`record` into `database`, under the database's own copy of its workload (another database's
    workload object is not one it can look up)."""
    workload = database.commit_workload(record.workload.mod)
    database.commit_tuning_record(TuningRecord(record.trace, workload, record.run_secs, record.target,
                                               record.args_info))
