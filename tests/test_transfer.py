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
    """A conv2d task and a real sibling: this CPU's records of it, tuned with 12 trials."""
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
    tune([task], profile.tvm_target(), sibling, _plan(profile, 12, "draft-verify"))
    return task, profile, sibling


def _plan(profile, trials: int, search: str, siblings=None, budget_s: float | None = None) -> TuningPlan:
    return TuningPlan(trials, budget_s, search, 0, profile.hardware.cores, profile.hardware, "cpu", profile.isa,
                      siblings=siblings)


@pytest.mark.serial
@pytest.mark.slow
def test_a_siblings_best_schedules_are_measured_first_and_keep_their_speed(tmp_path, conv_sibling):
    """The sibling's records warm-start a second device: its best schedule is measured first, alone, and the
    task's first round measures the other seeds, and nothing more. The sibling is this CPU, so its schedules
    keep their speed here: the best of the four runs within 1.5x of what the sibling measured. The sibling was
    timed minutes earlier, and this VM has run 2x slow for seconds at a time (a whole suite's run once timed the
    sibling's best at 0.94 ms here against its own 0.49): a warm start that misses is run once more, in a store
    of its own, and the faster of the two is judged. Schedules that lost their speed miss both times."""
    from edgetune.tuning.transfer.siblings import SEEDS_PER_TASK, load_sibling_records

    task, profile, sibling = conv_sibling
    target = profile.tvm_target()
    siblings = load_sibling_records({"sibling": sibling.directory}, [task], target, 2)
    fastest = float("inf")
    for attempt in ("warm", "warm-again"):
        warm = RecordStore(tmp_path / attempt)
        result = tune([task], target, warm, _plan(profile, SEEDS_PER_TASK, "evolutionary", siblings))
        kept = _seeds_kept(task, siblings, profile)
        first_warm, seeds_round, *search_rounds = warm.read_log()
        assert (first_warm["measured"], seeds_round["measured"]) == (1, kept - 1)
        assert sum(entry["measured"] for entry in search_rounds) == SEEDS_PER_TASK - kept
        assert result.transfer is not None and result.transfer.seeds_measured == kept
        assert warm.measured(task) == SEEDS_PER_TASK  # the seeds count against the trials: nothing beyond them
        assert len(_traces(warm, task) & _traces(sibling, task)) >= kept  # the seeds are the sibling's schedules
        best = warm.best_seconds(task)
        assert best is not None, (first_warm, seeds_round)  # every seed failed
        fastest = min(fastest, best)
        if fastest < 1.5 * sibling.best_seconds(task):
            break
    assert fastest < 1.5 * sibling.best_seconds(task), (fastest, sibling.best_seconds(task))


def _seeds_kept(task, siblings, profile) -> int:
    """How many of the task's sibling seeds a build measures: those that replay here as distinct programs
    keeping the cores busy (a sibling's 4 best may hold a single-threaded one, or two traces of one program)."""
    import tvm_ffi

    return len(_measured_seeds(task, siblings.seeds[tvm_ffi.structural_hash(task.mod)], profile))


def _measured_seeds(task, seeds, profile) -> list:
    """`measurable_seeds` of `seeds`, replayed with the task's postprocessors on the profile's cores."""
    from edgetune.tuning.search_strategy.seeded import measurable_seeds
    from edgetune.tuning.transfer.siblings import tuning_context

    postprocs = list(tuning_context(task, profile.tvm_target(), profile.hardware.cores).space_generator.postprocs)
    return measurable_seeds(task.mod, seeds, postprocs, profile.hardware.cores)


@pytest.mark.slow
def test_a_seed_two_siblings_share_is_measured_once(conv_sibling):
    """Two siblings may hold the same schedule (one tuned from the other's records): the build measures it once,
    and the seeds after it keep their places."""
    import tvm_ffi

    from edgetune.tuning.transfer.siblings import load_sibling_seeds

    task, profile, sibling = conv_sibling
    seeds = load_sibling_seeds({"sibling": sibling.directory}, [task]).seeds[tvm_ffi.structural_hash(task.mod)]
    alone = _measured_seeds(task, seeds, profile)
    shared = _measured_seeds(task, [seeds[0], *seeds], profile)
    assert [str(s.trace) for s in shared] == [str(s.trace) for s in alone]


def _traces(store: RecordStore, task) -> set[str]:
    """The schedules a store holds for a task, as text."""
    return {str(record.trace) for record in store.database.get_top_k(store.database.commit_workload(task.mod), 100)}


@pytest.fixture(scope="module")
def two_task_sibling(conv_sibling):
    """The conv sibling's store also holding a dense task, tuned with 8 trials."""
    import tvm
    from tvm import te, topi

    from edgetune.tuning.tasks import TuningTask

    conv, profile, sibling = conv_sibling
    data, weight = te.placeholder((16, 256), name="data"), te.placeholder((128, 256), name="weight")
    dense = TuningTask("dense", tvm.IRModule({"main": te.create_prim_func([data, weight, topi.nn.dense(data, weight)])}),
                       1, 2.0 * 16 * 256 * 128)
    tune([dense], profile.tvm_target(), sibling, _plan(profile, 8, "draft-verify"))
    return [conv, dense], profile, sibling


@pytest.mark.slow
def test_every_tasks_best_sibling_schedule_is_measured_in_one_batch_before_any_round(tmp_path, two_task_sibling):
    """With a sibling, the first thing measured is one batch of each task's best sibling schedule; the model's
    tuning curve starts when it ends, before the prior is loaded and before any task's round; each round
    then measures the task's other seeds, none twice."""
    from edgetune.tuning.transfer.siblings import SEEDS_PER_TASK, load_sibling_seeds

    tasks, profile, sibling = two_task_sibling
    siblings = load_sibling_seeds({"sibling": sibling.directory}, tasks)
    assert siblings.records_used == 0  # the prior's records are read inside the tuning, after the batch
    store = RecordStore(tmp_path / "warm")
    result = tune(tasks, profile.tvm_target(), store, _plan(profile, SEEDS_PER_TASK, "draft-verify", siblings))
    log = store.read_log()
    kept = {task.name: _seeds_kept(task, siblings, profile) for task in tasks}
    assert [(entry["task"], entry["measured"]) for entry in log[:2]] == [("conv", 1), ("dense", 1)]
    rounds = [(entry["task"], entry["measured"]) for entry in log[2:]]
    firsts = [next(batch for batch in rounds if batch[0] == task.name) for task in tasks]
    assert firsts == [(task.name, kept[task.name] - 1) for task in tasks]  # the first round's seeds, alone
    assert rounds.index(firsts[0]) < rounds.index(firsts[1])
    assert {name: sum(n for t, n in rounds if t == name) for name in kept} == {"conv": 3, "dense": 3}
    # the log says its times to the millisecond
    assert log[1]["elapsed_s"] <= round(result.curve[0][0], 3) <= log[2]["elapsed_s"]
    assert result.transfer.sibling_records > 0 and result.transfer.seeds_taken == kept
    for task in tasks:
        records = store.database.get_top_k(store.database.commit_workload(task.mod), 100)
        assert len({str(record.trace) for record in records}) == len(records) == SEEDS_PER_TASK


@pytest.mark.slow
def test_a_task_no_sibling_schedule_covers_gets_the_analyzers_best_drafts_in_the_siblings_batch(tmp_path,
                                                                                                 conv_sibling):
    """A task the sibling never measured (here a dense layer; in a ResNet-18, a convolution the sibling ran as
    Winograd) has the analyzer's best drafts built and timed in the first batch, beside the siblings' seeds:
    every kernel has a schedule when the batch ends, and the curve starts there; the task's round measures the
    rest of its trials, none twice; its drafts are not counted as the siblings' seeds."""
    import tvm
    from tvm import te, topi

    from edgetune.tuning.tasks import TuningTask
    from edgetune.tuning.transfer.siblings import load_sibling_seeds
    from edgetune.tuning.tune import FIRST_DRAFTS

    conv, profile, sibling = conv_sibling
    data, weight = te.placeholder((32, 128), name="data"), te.placeholder((64, 128), name="weight")
    unseen = TuningTask("unseen", tvm.IRModule({"main": te.create_prim_func([data, weight, topi.nn.dense(data, weight)])}),
                        1, 2.0 * 32 * 128 * 64)
    tasks, trials = [conv, unseen], 6
    store = RecordStore(tmp_path / "warm")
    result = tune(tasks, profile.tvm_target(), store,
                  _plan(profile, trials, "draft-verify", load_sibling_seeds({"sibling": sibling.directory}, tasks)))
    log = store.read_log()
    assert [(e["task"], e["measured"]) for e in log[:1 + FIRST_DRAFTS]] == [("conv", 1)] + [("unseen", 1)] * FIRST_DRAFTS
    assert all(e["batch_best_us"] for e in log[:1 + FIRST_DRAFTS])  # built and run
    # the log says its times to the millisecond
    assert log[FIRST_DRAFTS]["elapsed_s"] <= round(result.curve[0][0], 3) <= log[1 + FIRST_DRAFTS]["elapsed_s"]
    assert "unseen" not in result.transfer.seeds_taken and result.transfer.seeds_taken["conv"] >= 1
    records = store.database.get_top_k(store.database.commit_workload(unseen.mod), 100)
    assert len({str(record.trace) for record in records}) == len(records) == trials


@pytest.mark.slow
def test_a_task_the_siblings_never_measured_has_its_first_round_before_the_prior_is_read(tmp_path, conv_sibling):
    """The prior holds no records of a task the siblings never measured: that task's first round does not wait
    for it (reading it took 7 of the 12 s between a ResNet-18's first batch and its heaviest task's first round);
    the first round of a task with sibling schedules reads it first. The prior's rows, read on the tuning's
    workers, are the rows this process reads."""
    import numpy as np
    import tvm
    from tvm import te, topi

    from edgetune.tuning.tasks import TuningTask
    from edgetune.tuning.transfer.siblings import load_sibling_seeds
    from edgetune.tuning.tune import FIRST_DRAFTS

    conv, profile, sibling = conv_sibling
    data, weight = te.placeholder((32, 128), name="data"), te.placeholder((64, 128), name="weight")
    unseen = TuningTask("unseen", tvm.IRModule({"main": te.create_prim_func([data, weight, topi.nn.dense(data, weight)])}),
                        1, 2.0 * 32 * 128 * 64)
    tasks = [unseen, conv]
    siblings = load_sibling_seeds({"sibling": sibling.directory}, tasks)
    prior_read_at: list[tuple[str, bool]] = []
    store = RecordStore(tmp_path / "warm")
    tune(tasks, profile.tvm_target(), store, _plan(profile, 6, "draft-verify", siblings),
         progress=lambda p: prior_read_at.append((p.task, siblings.prior_loaded)))
    rounds = prior_read_at[1 + FIRST_DRAFTS:]  # after the first batch: conv's seed, unseen's drafts
    assert rounds[0] == ("unseen", False) and ("conv", True) in rounds and siblings.records_used > 0
    here = load_sibling_seeds({"sibling": sibling.directory}, tasks)
    here.load_prior(tasks, profile.tvm_target(), 2)
    assert list(here.groups) == list(siblings.groups)
    for key, (rows, costs) in here.groups.items():
        assert costs == siblings.groups[key][1] and np.array_equal(np.stack(rows), np.stack(siblings.groups[key][0]))


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
    siblings = load_sibling_records({"sibling": sibling.directory}, [task], target, 2)
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
    kept = _seeds_kept(task, siblings, profile)
    assert [len(hashes) for hashes in rounds] == [2, kept - 2] and not rounds[0] & rounds[1]
    assert stats.seeds_measured == kept and stats.seeds_taken == {"conv": kept}


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


def _scheduled_matmul(ways: int):
    """A 64x64 matmul whose outer loop is split `ways` ways and run in parallel (1: single-threaded)."""
    import tvm
    from tvm import te
    from tvm.s_tir import Schedule

    a = te.placeholder((64, 64), name="A")
    k = te.reduce_axis((0, 64), name="k")
    c = te.compute((64, 64), lambda i, j: te.sum(a[i, k] * a[k, j], axis=k), name="C")
    sch = Schedule(tvm.IRModule({"main": te.create_prim_func([a, c])}))
    i, _, _ = sch.get_loops(sch.get_sblock("C"))
    if ways > 1:
        outer, _ = sch.split(i, [ways, None])
        sch.parallel(outer)
    return sch


def test_single_threaded_sibling_schedules_give_way_to_parallel_ones_on_more_cores():
    """A 1-core sibling's best can leave this device's other cores idle: its seeds that leave more cores idle
    than another are dropped (single-threaded ones where a parallel one exists; 3 iterations on 2 cores where
    one splits evenly), not on one core, nor when none is parallel."""
    from edgetune.tuning.analyzer.tir import parallel_extent
    from edgetune.tuning.search_strategy.seeded import _balanced_where_possible

    single, two, three, eight = (_scheduled_matmul(ways) for ways in (1, 2, 3, 8))
    assert [parallel_extent(s.mod) for s in (single, two, three, eight)] == [1, 2, 3, 8]
    assert _balanced_where_possible([single, two, eight], cores=2) == [two, eight]
    assert _balanced_where_possible([single, three, eight], cores=2) == [eight]  # 3 iterations leave a core idle
    assert _balanced_where_possible([three, single], cores=2) == [three]  # none splits evenly: the busiest
    assert _balanced_where_possible([single, two], cores=1) == [single, two]
    assert _balanced_where_possible([single, single], cores=2) == [single, single]


def test_the_first_batch_takes_the_best_ranked_sibling_schedule_that_splits_evenly_over_the_cores():
    """A parallel loop of 3 iterations on 2 cores leaves one core waiting half the time: the first batch takes
    the siblings' next schedule that splits evenly, without replaying the ones after it; where none does, the
    best balanced, and on one core the siblings' best."""
    from edgetune.tuning.analyzer.tir import core_balance
    from edgetune.tuning.first_batch import first_balanced

    assert [core_balance(extent, 2) for extent in (1, 2, 3, 8, 9)] == [0.5, 1.0, 0.75, 1.0, 0.9]
    assert core_balance(3, 1) == 1.0
    single, two, three, eight = (_scheduled_matmul(ways) for ways in (1, 2, 3, 8))
    replayed: list[int] = []

    def ranked(*schedules):
        for rank, schedule in enumerate(schedules):
            replayed.append(rank)
            yield rank, schedule

    assert first_balanced(ranked(single, three, eight, two), cores=2) == (2, eight)
    assert replayed == [0, 1, 2]  # the fourth is not replayed
    assert first_balanced(ranked(single, three), cores=2) == (1, three)
    assert first_balanced(ranked(three, single, three), cores=2) == (0, three)
    assert first_balanced(ranked(single, eight), cores=1) == (0, single)
    assert first_balanced(ranked(), cores=2) is None


def test_a_siblings_best_records_are_read_without_opening_its_whole_store(conv_sibling, tmp_path):
    """`RankedStore` reads a store's best records of a task (what TVM's database would rank first), skipping
    damaged lines and failed runs, without replaying all of them; a task it never measured has none."""
    import shutil

    import tvm
    from tvm import te, topi
    from tvm.s_tir.meta_schedule.database import TuningRecord

    from edgetune.tuning.database.store import RECORD_FILE, RankedStore
    from edgetune.tuning.measurements import FAILED, mean_seconds
    from edgetune.tuning.tasks import TuningTask

    task, _, sibling = conv_sibling
    copy = tmp_path / "copy"
    shutil.copytree(sibling.directory, copy)
    with (copy / RECORD_FILE).open("a") as records:
        records.write('[0, [["cut short\n')
    workload = sibling.database.commit_workload(task.mod)
    expected = [r for r in sibling.database.get_top_k(workload, 100) if mean_seconds(r.run_secs) < FAILED][:5]
    stored, lines = RankedStore(copy).best_json(task, 5)
    best = [TuningRecord.from_json(line, stored) for line in lines]
    assert [mean_seconds(r.run_secs) for r in best] == [mean_seconds(r.run_secs) for r in expected]
    assert [str(r.trace) for r in best] == [str(r.trace) for r in expected]
    data = te.placeholder((1, 8, 8, 8), name="data")
    other = TuningTask("other", tvm.IRModule({"main": te.create_prim_func([data, topi.nn.relu(data)])}), 1, 1.0)
    assert RankedStore(copy).best_json(other, 5) is None


def test_a_sibling_seed_is_read_when_first_replayed_and_one_tvm_cannot_read_replays_to_nothing(conv_sibling):
    """Seeds are loaded unread; each is read (TVM replays its trace) when the first batch or its task's round
    replays it, and a record that parses as JSON but not as TVM's (a trace naming an instruction no TVM knows)
    gives no schedule instead of stopping the build."""
    from tvm.s_tir import meta_schedule as ms

    from edgetune.tuning.transfer.siblings import SiblingSchedule, load_sibling_seeds, tuning_context

    task, profile, sibling = conv_sibling
    seeds = load_sibling_seeds({"sibling": sibling.directory}, [task]).seeds
    (task_seeds,) = seeds.values()
    assert task_seeds and all(seed._trace is None for seed in task_seeds)
    postprocs = list(tuning_context(task, profile.tvm_target(), 2).space_generator.postprocs)
    schedule = task_seeds[0].replay(task.mod, postprocs, seed=1)
    assert schedule is not None and task_seeds[0]._trace is not None and task_seeds[1]._trace is None
    assert isinstance(schedule.mod, type(task.mod)) and ms.arg_info.ArgInfo.from_entry_func(schedule.mod)
    workload, record = task_seeds[0].workload, list(task_seeds[0].record)
    record[0] = [[["NoSuchInstruction", [], [], ["b0"]]], []]
    assert SiblingSchedule(workload, record).replay(task.mod, postprocs, seed=1) is None
