"""The symbol-based analyzer: orderings it must get right, agreement of its two readings, cost."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tvm
from tvm import te, topi
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms

from edgetune.profiles import Hardware, load_profile
from edgetune.tuning.analyzer import (
    CpuAnalyzer,
    GpuAnalyzer,
    SpaceModel,
    UnsupportedSpace,
    make_analyzer,
    nests_from_func,
)
from edgetune.tuning.intrinsics import register_tensor_intrinsics


def matmul(n: int) -> tvm.IRModule:
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c])})


def conv2d(channels: int = 128, size: int = 28) -> tvm.IRModule:
    data = te.placeholder((1, channels, size, size), name="data")
    weight = te.placeholder((channels, channels, 3, 3), name="weight")
    out = topi.nn.conv2d_nchw(data, weight, 1, 1, 1)
    return tvm.IRModule({"main": te.create_prim_func([data, weight, out])})


def context(mod: tvm.IRModule, profile: str, seed: int = -1) -> ms.TuneContext:
    """As a build makes one: the target's intrinsics first (TuneContext alone imports every backend's: 35 s)."""
    target = load_profile(profile).tvm_target()
    register_tensor_intrinsics(target)
    return ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply",
                          search_strategy="evolutionary", num_threads=2, rand_state=seed)


def cpu_latency(mod: tvm.IRModule) -> float:
    return float(CpuAnalyzer(load_profile("host").hardware).latency(nests_from_func(mod["main"]))[0])


def gpu_latency(mod: tvm.IRModule) -> float:
    return float(GpuAnalyzer(load_profile("a100").hardware).latency(nests_from_func(mod["main"]))[0])


def tiled_cpu_matmul(n: int, rows: int = 4, columns: int = 16) -> tvm.IRModule:
    """Register-blocked (rows x columns), cache-tiled, parallel over row blocks, vectorized along j."""
    sch = Schedule(matmul(n))
    block = sch.get_sblock("C")
    i, j, k = sch.get_loops(block)
    i0, i1, i2 = sch.split(i, [n // 64, 64 // rows, rows])
    j0, j1, j2 = sch.split(j, [n // 64, 64 // columns, columns])
    k0, k1 = sch.split(k, [n // 64, 64])
    sch.reorder(i0, j0, k0, i1, j1, k1, i2, j2)
    sch.parallel(sch.fuse(i0, j0))
    sch.unroll(i2)
    sch.vectorize(j2)
    return sch.mod


def test_cpu_tiled_parallel_vectorized_matmul_ranks_above_naive():
    naive = matmul(256)
    tiled = tiled_cpu_matmul(256)
    assert cpu_latency(tiled) * 4 < cpu_latency(naive)


def test_cpu_vectorizing_and_parallelizing_each_help():
    n = 256
    sch = Schedule(matmul(n))
    i, j, k = sch.get_loops(sch.get_sblock("C"))
    sch.reorder(i, k, j)
    serial = sch.mod
    _, j1 = sch.split(j, [n // 8, 8])
    sch.vectorize(j1)
    vectorized = sch.mod
    sch.parallel(i)
    both = sch.mod
    assert cpu_latency(both) < cpu_latency(vectorized) < cpu_latency(serial)


def gpu_matmul(blocks: int, threads: int, n: int = 512) -> tvm.IRModule:
    sch = Schedule(matmul(n))
    block = sch.get_sblock("C")
    i, j, _ = sch.get_loops(block)
    fused = sch.fuse(i, j)
    bx, tx, _ = sch.split(fused, [blocks, threads, n * n // (blocks * threads)])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod


def test_gpu_one_block_ranks_below_filling_the_sms():
    one_block = gpu_matmul(blocks=1, threads=256)
    full = gpu_matmul(blocks=1024, threads=256)
    for mod in (one_block, full):  # both are real CUDA programs (code generation only: no GPU here)
        with tvm.target.Target(load_profile("a100").tvm_target()):
            assert "__global__" in tvm.compile(mod, target=load_profile("a100").tvm_target()).mod.imports[0].inspect_source()
    assert gpu_latency(one_block) > 20 * gpu_latency(full)


def drafted_against_walked(mod: tvm.IRModule, ctx: ms.TuneContext, space, seed: int) -> float:
    """Correlation (of logs) between 24 random decision vectors' drafted latencies and the TIR walk's latencies
    of the schedules they build."""
    model = SpaceModel.analyze(mod, space)
    analyzer = CpuAnalyzer(load_profile("host").hardware)
    rows = model.sample(np.random.default_rng(seed), 24)
    drafted = analyzer.latency(model.nests(rows))
    walked = []
    for i, row in enumerate(rows):
        sch = model.materialize(mod, row, ctx.space_generator.postprocs, seed=i)
        assert sch is not None
        walked.append(analyzer.latency(nests_from_func(sch.mod["main"]))[0])
    return float(np.corrcoef(np.log(drafted), np.log(walked))[0, 1])


def test_structural_reading_agrees_with_the_tir_walk_on_cpu():
    """Scoring decisions (no schedule built) and reading the built schedule rank alike."""
    mod = matmul(256)
    ctx = context(mod, "host")
    assert drafted_against_walked(mod, ctx, ctx.space_generator.generate_design_space(mod)[0], seed=0) > 0.9


def winograd_conv2d(channels: int = 64, size: int = 14, tile: int = 4) -> tvm.IRModule:
    """An NHWC 3x3 convolution as edgetune's Winograd kernel: padding, tile gathering, data transform, batched
    GEMM, inverse transform and a ReLU, under edgetune's fused Winograd rule (explicit unrolls)."""
    from edgetune.frontend.winograd import winograd_conv2d_nhwc

    data = te.placeholder((1, size, size, channels), name="data")
    packed = te.placeholder((tile + 2, tile + 2, channels, channels), name="packed")
    out = topi.nn.relu(winograd_conv2d_nhwc(data, packed, [1, 1, 1, 1], "float32"))  # a fused epilogue reads it
    return tvm.IRModule({"main": te.create_prim_func([data, packed, out])})


def test_fused_winograd_spaces_are_drafted_by_sampling_and_read_by_the_tir_walk():
    """The fused Winograd rule computes its reductions (transforms, batched products) inside one parallel loop,
    which the structural vocabulary does not read: draft-verify drafts such spaces by TVM's sampling, and the TIR
    walk reads every candidate it builds."""
    mod = winograd_conv2d()
    for seed in range(4):
        ctx = context(mod, "host", seed)
        (space,) = ctx.space_generator.generate_design_space(mod)
        with pytest.raises(UnsupportedSpace):
            SpaceModel.analyze(mod, space)
        assert all(postproc.apply(space) for postproc in ctx.space_generator.postprocs)
        assert np.isfinite(cpu_latency(space.mod))


def test_gpu_space_validity_matches_verify_gpu_code():
    """Drafts the analyzer deems launchable are exactly those TVM's postprocessors accept."""
    mod = matmul(512)
    ctx = context(mod, "a100")
    analyzer = make_analyzer(load_profile("a100").hardware, "cuda")
    agree = total = 0
    for s, space in enumerate(ctx.space_generator.generate_design_space(mod)):
        model = SpaceModel.analyze(mod, space)
        rows = model.sample(np.random.default_rng(s), 40)
        launchable = np.isfinite(analyzer.latency(model.nests(rows)))
        for row, ok in zip(rows, launchable):
            accepted = model.materialize(mod, row, ctx.space_generator.postprocs, seed=1) is not None
            agree += accepted == ok
            total += 1
    assert agree / total >= 0.95


def test_unreadable_space_falls_back_to_the_tir_walk():
    """A cross-thread reduction space (rfactor) is outside the structural vocabulary."""
    x = te.placeholder((64, 4096), name="x")
    k = te.reduce_axis((0, 4096), name="k")
    total = te.compute((64,), lambda i: te.sum(x[i, k], axis=k), name="total")
    mod = tvm.IRModule({"main": te.create_prim_func([x, total])})
    ctx = context(mod, "host")
    spaces = ctx.space_generator.generate_design_space(mod)
    readable = []
    for space in spaces:
        try:
            SpaceModel.analyze(mod, space)
            readable.append(True)
        except UnsupportedSpace:
            readable.append(False)
            assert np.isfinite(cpu_latency(space.mod))
    assert not all(readable)


def test_draft_model_is_at_least_20x_cheaper_than_the_learned_model():
    """Per candidate: analyzer over decision vectors vs PerStoreFeature + XGBoost on schedules."""
    import xgboost as xgb
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate

    from edgetune.tuning.cost_model.ranking import RankingCostModel

    mod = conv2d()
    ctx = context(mod, "host")
    space = ctx.space_generator.generate_design_space(mod)[0]
    model = SpaceModel.analyze(mod, space)
    analyzer = CpuAnalyzer(load_profile("host").hardware)
    rng = np.random.default_rng(0)
    rows = model.sample(rng, 2048)
    analyzer.latency(model.nests(rows[:32]))
    begin = time.perf_counter()
    for _ in range(3):
        analyzer.latency(model.nests(rows))
    draft = (time.perf_counter() - begin) / (3 * len(rows))

    schedules = [s for s in (model.materialize(mod, r, ctx.space_generator.postprocs, i)
                             for i, r in enumerate(rows[:64])) if s is not None]
    candidates = [MeasureCandidate(s, ArgInfo.from_entry_func(s.mod, remove_preproc=True)) for s in schedules]
    learned = RankingCostModel(num_threads=2)
    features = learned.features(ctx, candidates[:16])
    data = xgb.DMatrix(features, label=rng.random(len(features)))
    data.set_group([len(features)])
    learned.booster = xgb.train({"objective": "rank:pairwise", "verbosity": 0}, data, 100)
    begin = time.perf_counter()
    learned.predict(ctx, candidates)
    verify = (time.perf_counter() - begin) / len(candidates)
    assert verify / draft >= 20, f"learned {verify * 1e3:.2f} ms vs draft {draft * 1e6:.1f} us per candidate"


@pytest.mark.parametrize("profile", ["host", "raspberry-pi-4", "x86-server"])
def test_cpu_analyzer_uses_the_profile(profile):
    """More cores and wider vectors make the same well-parallelized kernel faster."""
    hardware = load_profile(profile).hardware
    nests = nests_from_func(tiled_cpu_matmul(256)["main"])
    latency = CpuAnalyzer(hardware).latency(nests)[0]
    assert np.isfinite(latency) and latency > 0
    if profile == "x86-server":
        assert latency < CpuAnalyzer(load_profile("raspberry-pi-4").hardware).latency(nests)[0]


def test_cpu_analyzer_counts_the_pipes_the_host_profile_detects():
    """A Zen 4's AVX-512 runs on two 256-bit pipes: half the flops of two 512-bit pipes, which the profile's
    peak (the Winograd policy's) counts, while the analyzer's drafts keep counting two pipes."""
    host = load_profile("host").hardware
    assert host.vector_pipes == 2
    zen4 = host.model_copy(update={"vector_bits": 512, "flops_per_cycle": 32.0})
    full_rate = host.model_copy(update={"vector_bits": 512, "flops_per_cycle": 64.0})
    nests = nests_from_func(tiled_cpu_matmul(256, rows=8, columns=64)["main"])  # enough FMA chains for 2 pipes

    def compute_s(hardware: Hardware) -> float:
        return float(CpuAnalyzer(hardware).statement_times(nests[0])["compute"][0])

    assert compute_s(zen4) == compute_s(full_rate)
    counted_from_flops = zen4.model_copy(update={"vector_pipes": None})
    assert CpuAnalyzer(counted_from_flops).machine.pipes == 1.0
    assert compute_s(counted_from_flops) > 1.5 * compute_s(zen4)


def test_measured_traces_encode_back_to_their_decisions():
    """A built candidate's trace (postprocessors included) maps back to its decision vector."""
    mod = conv2d(32, 14)
    ctx = context(mod, "host")
    for space in ctx.space_generator.generate_design_space(mod):
        model = SpaceModel.analyze(mod, space)
        for i, row in enumerate(model.sample(np.random.default_rng(7), 6)):
            sch = model.materialize(mod, row, ctx.space_generator.postprocs, seed=i)
            assert sch is not None
            np.testing.assert_array_equal(model.encode(sch.trace), row)
