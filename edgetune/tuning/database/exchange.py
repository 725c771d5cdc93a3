"""Exchange of record stores between machines: `edgetune records export` writes stores into one
reproducible archive, `edgetune records import` merges one into the local stores, all or nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tvm_ffi
from tvm.s_tir.meta_schedule.database import TuningRecord

from edgetune.errors import EdgetuneError, InputError
from edgetune.tuning.database.store import (RECORD_FILE, WORKLOAD_FILE, RecordStore, commit_record,
                                            end_with_newline, scan_store)

EXPORT_FORMAT = "edgetune-records/1"
_INDEX = "index.json"
_CARRIED = (WORKLOAD_FILE, RECORD_FILE, "cost_model.npz", "tuning_log.jsonl")


def export_stores(stores: dict[str, Path], archive: Path) -> dict[str, int]:
    """Write the stores (directory name -> directory) into one reproducible .tar.gz; records per store.
    Damaged lines are left out, so what is exported imports cleanly."""
    from edgetune.archive import archive_directory

    counts = {}
    with tempfile.TemporaryDirectory() as scratch:
        stage = Path(scratch) / "edgetune-records"
        for name, directory in sorted(stores.items()):
            (stage / name).mkdir(parents=True)
            for file in _CARRIED[2:]:
                if (directory / file).is_file():
                    shutil.copyfile(directory / file, stage / name / file)
            scan = scan_store(directory)
            for file, lines in ((WORKLOAD_FILE, scan.workloads), (RECORD_FILE, scan.records)):
                if (directory / file).is_file():
                    (stage / name / file).write_text("".join(line + "\n" for line in lines))
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

    Every line and file of the archive is checked before anything is merged, and a failure while
    merging takes back what was added: all of the archive or none of it. Nothing local is removed or
    replaced: records are added unless the store holds the same one (same workload, trace, run
    times, target), tuning-log lines likewise, and the learned model's training data is merged.
    """
    with tempfile.TemporaryDirectory() as scratch:
        root, names = _unpack(archive, Path(scratch))
        problems = [p for name in names for p in _store_problems(archive, root, name)]
        if problems:
            raise InputError(problems + [f"{archive}: nothing was imported"])
        undo = _Undo()
        try:
            return [_merge_store(root / name, records_dir / name, undo) for name in names]
        except BaseException as exc:  # an interrupt too: none of the archive stays
            undo.run()
            if isinstance(exc, Exception) and not isinstance(exc, EdgetuneError):
                raise InputError(f"{archive}: merging failed ({type(exc).__name__}: {exc}); nothing was imported") \
                    from exc
            raise


def _store_problems(archive: Path, root: Path, name: str) -> list[str]:
    """Every reason one store of the archive cannot be merged, each naming the archive's member."""
    source_dir = root / name
    where = f"{archive}:edgetune-records/{name}"
    if not _STORE_NAME.fullmatch(name) or not (source_dir / RECORD_FILE).is_file():
        return [f"{archive}: store '{name}' listed in {_INDEX} has no records in the archive"]
    problems = [f"{archive}:edgetune-records/{name}/{d.path.name}:{d.line}: {d.reason}"
                for d in scan_store(source_dir, deep=True).damaged]
    log = source_dir / "tuning_log.jsonl"
    if log.is_file():
        for number, line in enumerate(log.read_bytes().split(b"\n"), start=1):
            try:
                if line.strip() and not isinstance(json.loads(line), dict):
                    raise ValueError("not an object")
            except (ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{where}/tuning_log.jsonl:{number}: expected a JSON object per line ({exc})")
    if (source_dir / "cost_model.npz").is_file():
        problems.extend(_cost_model_problems(source_dir / "cost_model.npz", f"{where}/cost_model.npz"))
    return problems


def _cost_model_problems(path: Path, where: str) -> list[str]:
    """The .npz holds plain arrays only (never pickles) with the keys RankingCostModel saves."""
    import numpy as np

    from edgetune.tuning.cost_model.ranking import RankingCostModel

    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            keys = meta["keys"]
            if not (isinstance(keys, list) and isinstance(meta.get("rounds"), int)):
                raise ValueError("meta: expected {'keys': [...], 'rounds': <int>}")
            fitted = meta.get("fitted", [0] * len(keys))
            if not (isinstance(fitted, list) and len(fitted) == len(keys)
                    and all(isinstance(n, int) and n >= 0 for n in fitted)):
                raise ValueError("meta: expected 'fitted', when given, to count each key's learned rows")
            for i in range(len(keys)):
                rows, costs = data[f"x{i}"], data[f"y{i}"]
                if rows.ndim != 2 or costs.ndim != 1 or len(rows) != len(costs) or rows.dtype.kind != "f":
                    raise ValueError(f"x{i}/y{i}: expected float features [N, F] and N costs")
        RankingCostModel(path=path)
    except Exception as exc:  # zip, numpy, JSON and XGBoost errors all mean the same: not a saved model
        return [f"{where}: not a cost model saved by edgetune ({type(exc).__name__}: {exc})"]
    return []


class _Undo:
    """What a merge changed, to take it back: appended files cut back to their length, and the
    replaced cost model (and created directories) restored."""

    def __init__(self) -> None:
        self.lengths: dict[Path, int] = {}
        self.saved_models: dict[Path, bytes | None] = {}
        self.created: list[Path] = []

    def before_append(self, path: Path) -> None:
        self.lengths.setdefault(path, path.stat().st_size if path.exists() else -1)

    def before_replace(self, path: Path) -> None:
        self.saved_models.setdefault(path, path.read_bytes() if path.exists() else None)

    def run(self) -> None:
        for path, length in self.lengths.items():
            if length < 0:
                path.unlink(missing_ok=True)
            elif path.exists():
                os.truncate(path, length)
        for path, data in self.saved_models.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)
        for directory in reversed(self.created):
            shutil.rmtree(directory, ignore_errors=True)


def _merge_store(source_dir: Path, target_dir: Path, undo: _Undo) -> ImportedStore:
    if not target_dir.exists():
        undo.created.append(target_dir)
    target = RecordStore(target_dir)
    for path in [*target.files(), target.log_path]:
        undo.before_append(path)
    if (source_dir / "cost_model.npz").is_file():
        undo.before_replace(target.directory / "cost_model.npz")
    source = RecordStore(source_dir)
    added = merge_store(source, target)
    return ImportedStore(source_dir.name, added, len(source.database) - added)


def merge_store(source: RecordStore, target: RecordStore) -> int:
    """Append the source's records that `target` lacks (same workload, trace, run times and target: the
    same measurement), its new tuning-log lines and its learned model's training data, through `target`'s
    own database (so a store open in this process sees them at once); the number of records added."""
    from edgetune.tuning.cost_model.ranking import RankingCostModel

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
        new = [line for line in source.log_path.read_text().splitlines() if line.strip() and line not in known_lines]
        end_with_newline(target.log_path)
        with target.log_path.open("a") as stream:
            stream.writelines(line + "\n" for line in new)
    if (source.directory / "cost_model.npz").is_file():
        model = RankingCostModel(path=target.directory / "cost_model.npz")
        model.merge(RankingCostModel(path=source.directory / "cost_model.npz"))
    target.sync()
    return added


_STORE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def _record_key(record: TuningRecord) -> tuple[int, str, tuple[float, ...], str]:
    """Same workload, schedule, run times and target: the same measurement."""
    return (tvm_ffi.structural_hash(record.workload.mod), str(record.trace.as_json()),
            tuple(float(s) for s in record.run_secs or []), str(record.target))


def _unpack(archive: Path, into: Path) -> tuple[Path, list[str]]:
    """The archive's top directory, every member checked before extraction, and its store names;
    InputError when it is not an export of `edgetune records export`."""
    from edgetune.archive import safe_extract

    try:
        safe_extract(archive, into)
    except InputError as exc:
        raise InputError([*exc.problems, f"{archive}: expected an archive from `edgetune records export`"]) from exc
    root = into / "edgetune-records"
    try:
        index = json.loads((root / _INDEX).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{archive}: no readable edgetune-records/{_INDEX} ({exc}); expected an archive from "
                         "`edgetune records export`") from exc
    if not isinstance(index, dict) or index.get("format") != EXPORT_FORMAT or not isinstance(index.get("stores"), dict):
        raise InputError(f"{archive}: {_INDEX} is not format {EXPORT_FORMAT!r}")
    return root, sorted(index["stores"])
