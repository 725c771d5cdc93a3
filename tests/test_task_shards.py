"""Task-level tuning split across workers: shards of a target's tasks searched in other processes, measured
through one RPC tracker key (two real servers on 127.0.0.1), merged into the target's store by its build."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgetune.fleet.endpoints import RemoteDevice
from edgetune.ownership import create_owned
from edgetune.tuning.shards import SHARDS_DIR, partition
from edgetune.tuning.tasks import TuningTask
from test_fleet import KEY, tracker_with_two_servers  # noqa: F401  (a fixture: two RPC servers on 127.0.0.1)

TRIALS = 2


def _task(name: str, flops: float, weight: int = 1) -> TuningTask:
    return TuningTask(name, None, weight, flops)  # partition reads only the work: FLOPs times calls


def test_partition_balances_the_work_and_is_deterministic() -> None:
    tasks = [_task("a", 100), _task("b", 60), _task("c", 50), _task("d", 10, weight=2), _task("e", 0)]
    groups = partition(tasks, 2)
    assert groups == partition(tasks, 2)
    assert sorted(p for g in groups for p in g) == [0, 1, 2, 3, 4]  # every task once
    work = [sum(tasks[p].total_flops for p in g) for g in groups]
    assert max(work) - min(work) <= 30
    assert partition(tasks, 9) == [[0], [1], [2], [3], [4]]  # never an empty shard
    assert partition(tasks[:1], 4) == [[0]] and partition([], 3) == []


@pytest.mark.slow
def test_shards_on_a_process_pool_measure_each_task_once_and_merge_a_dead_builds_shard(tracker_with_two_servers,
                                                                                      tmp_path: Path) -> None:
    from edgetune.devices import RpcDevice
    from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.database.store import RecordStore
    from edgetune.tuning.shards import tune_in_shards
    from edgetune.tuning.tune import TuningPlan, tune
    from edgetune.workers import ProcessShardPool

    host, _, port = tracker_with_two_servers[0].rpartition(":")
    target = resolve_profile("host", None).tvm_target()
    tasks = extract_lightest(target, 3, fuse_for_tuning, load_model, to_relax)
    device = RpcDevice("x86_64", RemoteDevice(host, int(port), KEY, 10.0, "gcc"))
    plan = TuningPlan(trials_per_task=TRIALS, time_budget_s=None, search="evolutionary", seed=1, cores=1,
                      runs_on=device)
    store = RecordStore(tmp_path / "records")

    # a build that died after a shard of it committed the third task's records
    leftover = tmp_path / "records" / SHARDS_DIR / "2-of-2"
    create_owned(leftover)
    tune(tasks[2:], target, RecordStore(leftover), plan)
    with (leftover / "database_tuning_record.json").open("a") as records:
        records.write('[0, [[["GetSBlock"')  # the dying worker's last line, cut short
    said: list[str] = []
    result = tune_in_shards(tasks, target, store, plan, ProcessShardPool(2), {}, tmp_path / "logs", said.append)

    assert f"merged {TRIALS} records that the shards of an interrupted build had committed" in said
    assert any(line.startswith("warning: ") and "database_tuning_record.json:" in line for line in said), said
    assert sum(line.startswith("shard ") for line in said) == 2, said  # the two tasks still wanting trials
    counts = store.measured_counts()
    lines = (tmp_path / "records" / "database_tuning_record.json").read_text().splitlines()
    assert len(lines) == len(set(lines)) == sum(counts.values())  # each measured once
    for task, outcome in zip(tasks, result.tasks):  # its trials, or every schedule its space has
        assert counts[_key(task)] == TRIALS or (outcome.space_exhausted and counts[_key(task)] >= 1), outcome
        assert outcome.trials_measured == counts[_key(task)] - outcome.trials_before
    assert [t.trials_before for t in result.tasks] == [0, 0, TRIALS]
    assert all(t.best_us and t.tuning_failed is None for t in result.tasks)
    assert result.curve and result.curve[-1][1] == pytest.approx(sum(t.weight * t.best_us for t in result.tasks)
                                                                 / 1e3)
    assert not [p for p in (tmp_path / "records" / SHARDS_DIR).iterdir() if p.is_dir()]  # merged: removed
    again = tune_in_shards(tasks, target, RecordStore(tmp_path / "records"), plan, ProcessShardPool(2), {},
                           tmp_path / "logs", said.append)
    # resumed: a task with all its trials gets none (one whose space ran short is searched again, as serially)
    assert all(t.trials_measured == 0 for t, first in zip(again.tasks, result.tasks) if not first.space_exhausted)


def extract_lightest(target, count: int, fuse_for_tuning, load_model, to_relax) -> list[TuningTask]:
    from edgetune.tuning.tasks import extract_tasks

    model = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    return extract_tasks(fuse_for_tuning(model, target), target)[-count:]


def _key(task: TuningTask) -> int:
    import tvm_ffi

    return tvm_ffi.structural_hash(task.mod)



def test_shards_transfer_figures_add_up_without_touching_the_first_shards() -> None:
    """Seeds measured per task in several shards add up in the target's figures; the first shard's own stays."""
    from edgetune.tuning.shards import _combined_transfer
    from edgetune.tuning.transfer.siblings import TransferStats

    first = TransferStats(["sibling"], "momentum", 10, seeds_taken={"conv": 4})
    second = TransferStats(["sibling"], "momentum", 5, seeds_taken={"dense": 3})
    total = _combined_transfer(_combined_transfer(None, first), second)
    assert (total.seeds_measured, total.sibling_records) == (7, 15)
    assert first.seeds_taken == {"conv": 4} and first.seeds_measured == 4
