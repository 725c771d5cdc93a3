"""Transfer between sibling devices: per-device stores, export/import, sibling order, the
transferred model and its guard, and a short real transfer run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_edgetune
from tvm.s_tir.meta_schedule.runner import RunnerResult

from edgetune.pipeline import order_fleet, record_stores
from edgetune.profiles import resolve_profile
from edgetune.recipe import load_recipe_text
from edgetune.tuning.cost_model.ranking import RankingCostModel
from edgetune.tuning.cost_model.transfer import TransferCostModel, spearman
from edgetune.tuning.database.exchange import export_stores, import_stores
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.transfer.siblings import SiblingRecords, TransferStats
from edgetune.tuning.tune import TuningPlan, tune

FLEET = """\
name: fleet
model: {zoo: tiny_cnn}
fleet:
  - name: board-b
    profile: raspberry-pi-4
    transfer_from: [board-a]
  - name: host-2
    profile: host
  - name: board-a
    profile: cortex-a53
  - name: host-1
    profile: host
    overrides: {target: {num-cores: 1}, hardware: {cores: 1}}
  - name: gpu
    profile: jetson-orin
  - name: alone
    profile: cortex-a53
    transfer_from: []
tuning: {trials_per_task: 0}
"""


def fleet_recipe(tmp_path: Path, text: str = FLEET):
    return load_recipe_text(text, base_dir=tmp_path)


def profiles_of(recipe):
    return {t.name: resolve_profile(t.profile, t.overrides) for t in recipe.fleet}


def test_siblings_tune_first_named_or_picked_by_isa_family(tmp_path):
    recipe = fleet_recipe(tmp_path)
    order, siblings = order_fleet(recipe.fleet, profiles_of(recipe))
    names = [t.name for t in order]
    assert names.index("board-a") < names.index("board-b")
    assert siblings["board-b"] == ["board-a"]  # named in the recipe
    assert siblings["host-1"] == ["host-2"]  # same ISA family and device, tuned before it
    assert siblings["host-2"] == [] and siblings["board-a"] == [] and siblings["gpu"] == []
    assert siblings["alone"] == []  # transfer_from: [] turns it off


def test_each_device_gets_its_own_store_and_its_own_best(tmp_path, matmul_records):
    """One workload measured on two devices: neither store hands out the other's schedule."""
    recipe = fleet_recipe(tmp_path)
    stores = record_stores(recipe, profiles_of(recipe))
    assert len({s.directory for s in stores.values()}) == len(stores)
    assert stores["host-1"].directory.parent == tmp_path / "build" / "fleet" / "records"
    fast, slow = RecordStore(stores["host-2"].directory), RecordStore(stores["host-1"].directory)
    task, traces = matmul_records
    commit(fast, task, traces[:4], [1e-3, 2e-3, 3e-3, 4e-3])
    commit(slow, task, traces[:4], [9e-3, 8e-3, 7e-3, 6e-3])
    assert fast.best_seconds(task) == pytest.approx(1e-3)
    assert slow.best_seconds(task) == pytest.approx(6e-3)
    changed = fleet_recipe(tmp_path, FLEET.replace("num-cores: 1}, hardware: {cores: 1}", "num-cores: 3}, hardware: {cores: 3}"))
    assert record_stores(changed, profiles_of(changed))["host-1"].directory != stores["host-1"].directory


def test_stores_live_where_the_recipe_or_the_flag_says(tmp_path):
    recipe = fleet_recipe(tmp_path, FLEET + "records_dir: ../cache\n")
    stores = record_stores(recipe, profiles_of(recipe))
    assert stores["host-2"].directory.parent == (tmp_path / ".." / "cache").resolve()
    flagged = record_stores(recipe, profiles_of(recipe), tmp_path / "elsewhere")
    assert flagged["host-2"].directory == tmp_path / "elsewhere" / stores["host-2"].directory.name


def test_export_import_round_trip_keeps_every_record_and_adds_none_twice(tmp_path, matmul_records):
    task, traces = matmul_records
    source = RecordStore(tmp_path / "here" / "host-1-abc")
    commit(source, task, traces[:5], [5e-3, 4e-3, 3e-3, 2e-3, 1e-3])
    source.log_batch({"task": "t", "measured": 5})
    archive = tmp_path / "records.tar.gz"
    assert export_stores({"host-1-abc": source.directory}, archive) == {"host-1-abc": 5}
    again = tmp_path / "again.tar.gz"
    export_stores({"host-1-abc": source.directory}, again)
    assert archive.read_bytes() == again.read_bytes()  # reproducible

    elsewhere = tmp_path / "there"
    local = RecordStore(elsewhere / "host-1-abc")
    commit(local, task, traces[5:7], [9e-3, 8e-3])  # measured there before the import
    [imported] = import_stores(archive, elsewhere)
    assert (imported.name, imported.added, imported.present) == ("host-1-abc", 5, 0)
    merged = RecordStore(elsewhere / "host-1-abc")
    assert merged.measured(task) == 7 and merged.best_seconds(task) == pytest.approx(1e-3)
    assert len(merged.read_log()) == 1
    [twice] = import_stores(archive, elsewhere)
    assert (twice.added, twice.present) == (0, 5)
    assert RecordStore(elsewhere / "host-1-abc").measured(task) == 7


def test_records_import_names_a_bad_archive_and_exits_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(FLEET)
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_text("not an archive")
    run = run_edgetune("records", "import", str(recipe), str(bogus), cwd=tmp_path)
    assert run.returncode == 2
    assert "bogus.tar.gz" in run.stderr and "edgetune records export" in run.stderr


def test_recipe_rejects_transfer_in_a_circle(tmp_path):
    text = FLEET.replace("    profile: cortex-a53\n  - name: host-1", "    profile: cortex-a53\n    transfer_from: [board-b]\n  - name: host-1")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    run = run_edgetune("validate", str(recipe), cwd=tmp_path)
    assert run.returncode == 2
    assert "r.yaml:" in run.stderr and "transfer_from" in run.stderr and "circle" in run.stderr


def synthetic(rng, n: int, sign: float) -> tuple[np.ndarray, list[RunnerResult]]:
    """Rows whose first feature sets the run time (faster with larger values when sign > 0)."""
    rows = rng.random((n, 5)).astype(np.float32)
    seconds = 1e-3 * np.exp(-sign * 2.0 * rows[:, 0]) * (1 + 0.02 * rng.random(n))
    return rows, [RunnerResult([float(s)], None) for s in seconds]


def sibling_data(rng, sign: float) -> SiblingRecords:
    rows, results = synthetic(rng, 64, sign)
    return SiblingRecords(["sib"], {"sib/task": (list(rows), [float(r.run_secs[0]) for r in results])})


@pytest.mark.parametrize("mode", ["momentum", "warm"])
def test_transferred_model_ranks_before_any_measurement_and_adapts(mode):
    rng = np.random.default_rng(0)
    stats = TransferStats(["sib"], mode, 64)
    model = TransferCostModel(RankingCostModel(num_threads=1), sibling_data(rng, +1.0), mode, stats)
    probe, probe_results = synthetic(rng, 40, +1.0)
    truth = -np.array([float(r.run_secs[0]) for r in probe_results])
    assert spearman(model.predict_rows(probe), truth) > 0.8  # the prior alone, before this device measured
    for _ in range(3):
        rows, results = synthetic(rng, 8, +1.0)
        model.learn("task", "conv", rows, results)
    assert model.trusted("task") and not stats.distrusted
    assert spearman(model.predict_rows(probe), truth) > 0.8


def test_guard_sets_a_misleading_sibling_aside():
    """The sibling's order is the reverse of this device's: after a few measurements the task is
    predicted from the device's own data, and a search weighing the prior is told so."""
    rng = np.random.default_rng(1)
    stats = TransferStats(["sib"], "momentum", 64)
    model = TransferCostModel(RankingCostModel(num_threads=1), sibling_data(rng, -1.0), "momentum", stats)
    assert model.trusted("task")
    for _ in range(2):
        rows, results = synthetic(rng, 8, +1.0)
        model.learn("task", "conv", rows, results)
    assert not model.trusted("task") and stats.distrusted == {"conv"}


@pytest.fixture(scope="module")
def conv_sibling(tmp_path_factory):
    """A conv2d task and a real sibling: this CPU's records of it, tuned with 24 trials."""
    import tvm
    from tvm import te, topi
    from tvm.s_tir.analysis import estimate_tir_flops

    from edgetune.profiles import load_profile
    from edgetune.tuning.tasks import TuningTask

    data = te.placeholder((1, 64, 28, 28), name="data")
    weight = te.placeholder((64, 64, 3, 3), name="weight")
    mod = tvm.IRModule({"main": te.create_prim_func([data, weight, topi.nn.conv2d_nchw(data, weight, 1, 1, 1)])})
    task = TuningTask("conv", mod, 1, float(estimate_tir_flops(mod)))
    profile = load_profile("host")
    sibling = RecordStore(tmp_path_factory.mktemp("sibling"))
    tune([task], profile.tvm_target(), sibling, _plan(profile, 24, "draft-verify"))
    return task, profile, sibling


def _plan(profile, trials: int, search: str, siblings=None, budget_s: float | None = None) -> TuningPlan:
    return TuningPlan(trials, budget_s, search, 0, profile.hardware.cores, profile.hardware, "cpu", profile.isa,
                      siblings=siblings)


@pytest.mark.slow
def test_first_batch_with_a_siblings_records_beats_a_scratch_first_batch(tmp_path, conv_sibling):
    """The sibling's records warm-start a second device: the first batch measured with transfer is faster
    than the first batch from scratch."""
    from edgetune.tuning.transfer.siblings import load_sibling_records

    task, profile, sibling = conv_sibling
    target = profile.tvm_target()
    scratch, warm = RecordStore(tmp_path / "scratch"), RecordStore(tmp_path / "warm")
    tune([task], target, scratch, _plan(profile, 4, "evolutionary"))  # one batch each: the first batches are compared
    siblings = load_sibling_records({"sibling": sibling}, [task], target, 2)
    result = tune([task], target, warm, _plan(profile, 4, "evolutionary", siblings))
    first_scratch, first_warm = scratch.read_log()[0], warm.read_log()[0]
    assert result.transfer is not None and result.transfer.seeds_measured == first_warm["measured"] == 4
    assert first_warm["batch_best_us"] < first_scratch["batch_best_us"], (first_warm, first_scratch)
    assert warm.measured(task) == 4  # the seeds count against the budget: nothing is measured beyond them


@pytest.mark.slow
def test_seeds_a_cut_round_left_out_open_the_tasks_next_round(conv_sibling):
    """A first round cut to 2 trials (the first pass's share of the budget) measures the 2 best sibling
    schedules; the task's next round in the same build starts with the other 2, and none is measured twice."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    from edgetune.tuning.search_strategy.draft_verify import DraftVerifySearch
    from edgetune.tuning.search_strategy.seeded import SeededSearch
    from edgetune.tuning.transfer.siblings import SEEDS_PER_TASK, load_sibling_records

    task, profile, sibling = conv_sibling
    target = profile.tvm_target()
    siblings = load_sibling_records({"sibling": sibling}, [task], target, 2)
    stats = TransferStats(["sibling"], "momentum", siblings.records_used)
    database = ms.database.MemoryDatabase()
    rounds = []
    for trials in (2, SEEDS_PER_TASK):
        inner = DraftVerifySearch(profile.hardware, "cpu", population=256, verify=16)
        strategy = SeededSearch(inner, siblings.seeds, stats)
        context = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                                 search_strategy=strategy, task_name="conv", rand_state=1, num_threads=2)
        spaces = context.space_generator.generate_design_space(task.mod)
        strategy.pre_tuning(trials, trials, spaces, database, RankingCostModel(num_threads=2))
        batch = strategy.generate_measure_candidates()
        rounds.append({tvm_ffi.structural_hash(candidate.sch.mod) for candidate in batch})
        strategy.notify_runner_results(batch, [RunnerResult([1e-3], None) for _ in batch])
    assert [len(hashes) for hashes in rounds] == [2, SEEDS_PER_TASK - 2] and not rounds[0] & rounds[1]
    assert stats.seeds_measured == SEEDS_PER_TASK and stats.seeds_taken == {"conv": SEEDS_PER_TASK}


@pytest.fixture(scope="module")
def matmul_records():
    """A small matmul task and distinct real schedules of it (tile sizes mutated)."""
    import tvm
    from tvm import te
    from tvm.s_tir import Schedule

    from edgetune.tuning.tasks import TuningTask

    a = te.placeholder((64, 64), name="A")
    b = te.placeholder((64, 64), name="B")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b, c])})
    traces, seen = [], set()
    for seed in range(1, 64):  # tile sizes sampled by TVM: a different schedule per seed
        schedule = Schedule(mod, seed=seed)
        i, j, _ = schedule.get_loops(schedule.get_sblock("C"))
        schedule.split(i, schedule.sample_perfect_tile(i, n=2))
        schedule.split(j, schedule.sample_perfect_tile(j, n=2))
        if str(schedule.trace) not in seen:
            seen.add(str(schedule.trace))
            traces.append(schedule.trace)
        if len(traces) == 8:
            break
    assert len(traces) == 8
    return TuningTask("matmul", mod, 1, 2.0 * 64**3), traces


COMMIT_TARGET = {"kind": "llvm", "num-cores": 2}


def commit(store: RecordStore, task, traces, seconds: list[float]) -> None:
    """Records of `task` as if measured: these schedules with these run times."""
    import tvm
    from tvm.s_tir.meta_schedule.database import TuningRecord

    workload = store.database.commit_workload(task.mod)
    for trace, secs in zip(traces, seconds):
        store.database.commit_tuning_record(TuningRecord(trace, workload, [secs], tvm.target.Target(COMMIT_TARGET)))
