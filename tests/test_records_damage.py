"""Record stores a kill or a full disk damaged: damaged lines are reported (file:line) and skipped,
every other record is kept and used, appends start on a fresh line, `records check/repair` find and
drop them, and `records import` refuses an archive with one bad line without changing anything."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import run_edgetune
from tvm.s_tir.meta_schedule.database import JSONDatabase, TuningRecord, Workload

from edgetune.tuning.database.store import RECORD_FILE, WORKLOAD_FILE, RecordStore, commit_record, scan_store


def _store_of(build_dir: Path) -> Path:
    [store] = [p for p in (build_dir / "out" / "tiny" / "records").iterdir() if p.is_dir()]  # not the marker
    return store


def _copy_build(tiny_build, destination: Path) -> Path:
    directory, _ = tiny_build
    shutil.copytree(directory, destination, symlinks=True)
    return destination


def _lines(path: Path) -> list[str]:
    return path.read_text().split("\n")


@pytest.fixture(scope="module")
def rebuilt_after_truncation(tiny_build, tmp_path_factory):
    """tiny_build's directory, last record cut short, built again (signed, to cover fresh signing)."""
    directory = _copy_build(tiny_build, tmp_path_factory.mktemp("damaged") / "build")
    records = _store_of(directory) / RECORD_FILE
    before = records.read_bytes()
    records.write_bytes(before[:-40])  # what a kill in the middle of a write leaves: no newline, no end
    kept = len(before.splitlines()) - 1
    keys = run_edgetune("keygen", "key.pem", cwd=directory)
    assert keys.returncode == 0, keys.stderr
    run = run_edgetune("build", "tiny.yaml", "--sign-key", "key.pem", cwd=directory)
    return directory, run, kept


@pytest.mark.slow
def test_a_truncated_last_record_is_reported_and_the_rest_are_kept(rebuilt_after_truncation) -> None:
    directory, run, kept = rebuilt_after_truncation
    assert run.returncode == 0, run.stdout + run.stderr
    records = _store_of(directory) / RECORD_FILE
    assert f"warning: {records}:{kept + 1}: not JSON" in run.stdout
    scan = scan_store(records.parent)
    assert [d.line for d in scan.damaged] == [kept + 1]
    # the kept records were used (their tasks needed no new trial), the new one started on a line of its own
    assert len(scan.records) == kept + 1 and records.read_bytes().endswith(b"\n")
    verified = run_edgetune("verify", "out/tiny/host.tar.gz", "--trust", "key.pem.pub", cwd=directory)
    assert verified.returncode == 0, verified.stderr


@pytest.mark.slow
def test_records_check_and_repair(rebuilt_after_truncation) -> None:
    directory, _, kept = rebuilt_after_truncation
    store = _store_of(directory)
    damaged_bytes = (store / RECORD_FILE).read_bytes()
    check = run_edgetune("records", "check", "tiny.yaml", cwd=directory)
    assert check.returncode == 1 and f"{store / RECORD_FILE}:{kept + 1}" in check.stderr
    repair = run_edgetune("records", "repair", "tiny.yaml", cwd=directory)
    assert repair.returncode == 0, repair.stderr
    [backup] = store.glob(f"{RECORD_FILE}.bak-*")
    assert backup.read_bytes() == damaged_bytes
    assert run_edgetune("records", "check", "tiny.yaml", cwd=directory).returncode == 0
    direct = JSONDatabase(path_workload=str(store / WORKLOAD_FILE), path_tuning_record=str(store / RECORD_FILE),
                          module_equality="anchor-block")
    assert len(direct) == kept + 1  # TVM's own reader takes the repaired store


def test_a_damaged_workload_line_keeps_record_indices_right(tiny_build, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    shutil.copytree(_store_of(tiny_build[0]), store_dir)
    workloads, records = _lines(store_dir / WORKLOAD_FILE)[:-1], _lines(store_dir / RECORD_FILE)[:-1]
    by_workload = [json.loads(line)[0] for line in records]
    first = Workload.from_json(json.loads(workloads[0]))
    (store_dir / WORKLOAD_FILE).write_text(workloads[0][:80] + "\n" + "\n".join(workloads[1:]) + "\n")
    (store_dir / RECORD_FILE).write_text("\n" + "\n".join(records) + "\n")  # and an empty line TVM crashes on

    store = RecordStore(store_dir)
    warnings = "\n".join(store.damage_warnings())
    assert f"{store_dir / WORKLOAD_FILE}:1: not JSON" in warnings and f"{store_dir / RECORD_FILE}:1:" in warnings
    survivors = [r for r in by_workload if r != 0]
    assert len(store.database) == len(survivors)
    # a record of a surviving workload goes back under its original line; a new workload gets the next line
    commit_record(store.database, store.database.get_all_tuning_records()[0])
    commit_record(store.database, TuningRecord.from_json(json.loads(records[0])[1], first))
    store.sync()
    appended = [json.loads(line)[0] for line in _lines(store_dir / RECORD_FILE)[len(records) + 1:-1]]
    assert appended == [survivors[0], len(workloads)]
    assert len(_lines(store_dir / WORKLOAD_FILE)) - 1 == len(workloads) + 1
    assert len(RecordStore(store_dir).database) == len(survivors) + 2


@pytest.fixture(scope="module")
def exported(tiny_build, tmp_path_factory) -> Path:
    """The tiny build's records, exported once by `edgetune records export`."""
    directory = _copy_build(tiny_build, tmp_path_factory.mktemp("export") / "build")
    archive = directory.parent / "records.tar.gz"
    run = run_edgetune("records", "export", "tiny.yaml", "-o", str(archive), cwd=directory)
    assert run.returncode == 0, run.stderr
    return archive


def _exported(tiny_build, exported: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the tiny build and of its exported records, for one test to change."""
    directory = _copy_build(tiny_build, tmp_path / "build")
    archive = tmp_path / "records.tar.gz"
    shutil.copyfile(exported, archive)
    return directory, archive


def _rewrite_member(archive: Path, suffix: str, change) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    with tarfile.open(archive, "w:gz") as tar:
        for member, data in members:
            if data is not None and member.name.endswith(suffix):
                data = change(data)
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _cost_model_counting(fitted) -> bytes:
    """A saved cost model whose meta counts its learned rows as `fitted` says (RankingCostModel.save's layout)."""
    import json

    import numpy as np

    buffer = io.BytesIO()
    meta = json.dumps({"keys": ["task"], "rounds": 5, "fitted": fitted}).encode()
    np.savez(buffer, meta=np.frombuffer(meta, dtype=np.uint8), model=np.zeros(0, dtype=np.uint8),
             x0=np.ones((2, 3), dtype=np.float32), y0=np.array([1e-3, 2e-3]))
    return buffer.getvalue()


UNKNOWN_INSTRUCTION = b'[0, [[[["NoSuchInstruction", [], [], []]], []], [1e-3], {"kind": "llvm"}, []]]\n'


@pytest.mark.parametrize("suffix, change, expected", [
    (RECORD_FILE, lambda data: data.replace(b"\n", b"\n[0,[]]\n", 1), f"{RECORD_FILE}:2: expected a tuning record"),
    (RECORD_FILE, lambda data: data + UNKNOWN_INSTRUCTION, "TVM cannot parse it"),
    ("cost_model.npz", lambda data: b"garbage", "cost_model.npz: not a cost model saved by edgetune"),
    ("cost_model.npz", lambda data: _cost_model_counting([-1]), "expected 'fitted', when given, to count"),
    ("cost_model.npz", lambda data: _cost_model_counting(["2"]), "expected 'fitted', when given, to count"),
    ("tuning_log.jsonl", lambda data: data + b"{cut short\n", "tuning_log.jsonl:"),
], ids=["bad-shape", "tvm-rejects", "garbage-cost-model", "negative-fitted-count", "text-fitted-count",
                         "bad-log-line"])
def test_an_import_with_one_bad_part_changes_nothing(tiny_build, exported, tmp_path: Path, suffix, change,
                                                     expected) -> None:
    directory, archive = _exported(tiny_build, exported, tmp_path)
    with tarfile.open(archive, "r:gz") as tar:
        present = any(name.endswith(suffix) for name in tar.getnames())
    if not present:  # a store whose search kept no learned model: give the archive one
        _add_member(archive, suffix, change(b""))
    else:
        _rewrite_member(archive, suffix, change)
    records_root = directory / "out" / "tiny" / "records"
    before = _snapshot(records_root)
    run = run_edgetune("records", "import", "tiny.yaml", str(archive), cwd=directory)
    assert run.returncode == 2 and expected in run.stderr and "nothing was imported" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert _snapshot(records_root) == before


def _add_member(archive: Path, name: str, data: bytes) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    store = next(m.name for m, _ in members if m.name.endswith(RECORD_FILE)).rsplit("/", 1)[0]
    extra = tarfile.TarInfo(f"{store}/{name}")
    extra.size = len(data)
    with tarfile.open(archive, "w:gz") as tar:
        for member, content in [*members, (extra, data)]:
            tar.addfile(member, io.BytesIO(content) if content is not None else None)
