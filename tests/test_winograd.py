"""3x3 stride-1 convolutions run as Winograd kernels on CPU targets where the device's roofline says
they pay; the others stay direct."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import save_image_model
from onnx import helper, numpy_helper

from edgetune.frontend.onnx import LoadedModel, fuse_for_tuning, to_relax
from edgetune.frontend.winograd import WinogradPolicy
from edgetune.profiles import resolve_profile
from edgetune.tuning.tasks import extract_tasks

HOST_LIKE = WinogradPolicy(peak_gflops=156.5, memory_bandwidth_gbs=20.0)  # 2 AVX2 cores, DDR4


def _policy(profile: str) -> WinogradPolicy:
    """The profile's roofline policy; the host's numbers are the test machine's (on a 2-core AVX-512 VM
    this block's convolutions stay direct), so the host gets a fixed 2-core AVX2 machine's."""
    if profile == "host":
        return HOST_LIKE
    hardware = resolve_profile(profile, None).hardware
    return WinogradPolicy(hardware.peak_gflops, hardware.memory_bandwidth_gbs)


def test_policy_picks_the_tile_by_roofline() -> None:
    # ResNet-18's 56x56x64 conv is compute-bound: the larger tile saves the most multiplications
    assert HOST_LIKE.tile(1, 56, 56, 64, 64) == 4
    # its 7x7x512 conv is weight-bound: F(4x4)'s weights are 4x the direct ones, F(2x2)'s 1.8x
    assert HOST_LIKE.tile(1, 7, 7, 512, 512) == 2
    # a few channels on a small map: the transforms cost more than they save
    assert HOST_LIKE.tile(1, 8, 8, 3, 8) is None
    # a starved memory system keeps the last stage direct
    assert WinogradPolicy(peak_gflops=156.5, memory_bandwidth_gbs=2.0).tile(1, 7, 7, 512, 512) is None


def _residual_block(path: Path) -> LoadedModel:
    """A ResNet basic block with a strided 3x3 and a 1x1 shortcut beside the 3x3 stride-1 convs, and
    the next block's first conv: the same 32 -> 32 convolution as the block's second, with a ReLU
    epilogue instead of the residual add (ResNet's twin kernels)."""
    rng = np.random.default_rng(0)

    def init(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)

    initializers = [init("w1", (32, 16, 3, 3)), init("b1", (32,)), init("w2", (32, 32, 3, 3)), init("b2", (32,)),
                    init("ws", (32, 16, 1, 1)), init("w4", (32, 32, 3, 3)), init("b4", (32,)),
                    init("w3", (32, 32, 3, 3))]
    nodes = [
        helper.make_node("Conv", ["data", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["data", "ws"], ["shortcut"]),
        helper.make_node("Add", ["c2", "shortcut"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["r2"]),
        helper.make_node("Conv", ["r2", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c4"], ["r4"]),
        helper.make_node("Conv", ["r4", "w3"], ["c3"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["c3"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["logits"]),
    ]
    return save_image_model(path, "residual_block", nodes, [1, 16, 27, 30], 32, initializers)


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    return _residual_block(tmp_path_factory.mktemp("winograd") / "block.onnx")


def _conv_task_names(model, profile: str, winograd: bool) -> list[str]:
    target = resolve_profile(profile, None).tvm_target()
    policy = _policy(profile) if winograd else None
    return sorted(t.name for t in extract_tasks(fuse_for_tuning(to_relax(model), target, policy), target)
                  if "conv2d" in t.name)


@pytest.mark.parametrize("profile", ["host", "raspberry-pi-4"])
def test_stride_1_3x3_convolutions_become_winograd_kernels_with_their_epilogue(block, profile) -> None:
    names = _conv_task_names(block, profile, winograd=True)
    winograd = [n for n in names if "winograd_f4" in n]
    assert len(winograd) == 2, names  # 16 -> 32 conv+bias+relu; 32 -> 32 conv+bias+shortcut add+relu and its twin
    assert all("relu" in n for n in winograd), winograd
    direct = [n for n in names if "winograd" not in n]
    assert len(direct) == 2, names  # the 1x1 shortcut and the strided 3x3
    # the weight transform is folded into the constants: no kernel of its own is left to tune
    target = resolve_profile(profile, None).tvm_target()
    every = [t.name for t in extract_tasks(fuse_for_tuning(to_relax(block), target, _policy(profile)), target)]
    assert not [n for n in every if "weight_transform" in n], every


def test_winograd_off_keeps_direct_convolutions(block) -> None:
    names = _conv_task_names(block, "host", winograd=False)
    assert len(names) == 4 and not [n for n in names if "winograd" in n], names  # the twins are one task


def test_kernels_that_differ_only_in_their_epilogue_are_one_task(block) -> None:
    target = resolve_profile("host", None).tvm_target()
    tasks = extract_tasks(fuse_for_tuning(to_relax(block), target, _policy("host")), target)
    weights = sorted(t.weight for t in tasks if "winograd" in t.name)
    assert weights == [1, 2], [(t.name, t.weight) for t in tasks]


def test_gpu_targets_get_no_winograd(block) -> None:
    assert not [n for n in _conv_task_names(block, "a100", winograd=True) if "winograd" in n]


def test_convolutions_of_one_input_with_different_weights_stay_two_tasks(tmp_path) -> None:
    """With few output channels the data transform is the kernel's anchor block; two convolutions that
    read the same input must not pass for twins."""
    rng = np.random.default_rng(1)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("wa", (32, 16, 3, 3)), ("wb", (16, 16, 3, 3)))]
    nodes = [
        helper.make_node("Conv", ["data", "wa"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["ra"]),
        helper.make_node("Conv", ["data", "wb"], ["b"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["b"], ["rb"]),
        helper.make_node("Concat", ["ra", "rb"], ["both"], axis=1),
        helper.make_node("GlobalAveragePool", ["both"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["logits"]),
    ]
    branches = save_image_model(tmp_path / "branches.onnx", "branches", nodes, [1, 16, 27, 30], 48, weights)
    target = resolve_profile("host", None).tvm_target()
    tasks = extract_tasks(fuse_for_tuning(to_relax(branches), target, HOST_LIKE), target)
    assert sorted(t.weight for t in tasks if "winograd" in t.name) == [1, 1], [(t.name, t.weight) for t in tasks]


def test_winograd_model_computes_what_onnx_runtime_does(block) -> None:
    import tvm

    from edgetune.compile import compile_model
    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import run

    target = resolve_profile("host", None).tvm_target()
    x = block.sample_inputs(seed=3)
    executable = compile_model(to_relax(block), target, None, _policy("host"))
    assert "winograd" in executable.as_text()
    vm = tvm.relax.VirtualMachine(executable, tvm.cpu())
    ours = run(vm, [x["data"]], tvm.cpu())[0]
    expected = ReferenceRuntime(block)._session(1).run(None, x)[0]
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [2, 4])
def test_constant_weights_transformed_in_numpy_equal_the_transform_kernel(tile: int) -> None:
    """`winograd_weight_values` (what constant weights get) against `winograd_weight_transform` compiled by TVM
    and run (what a weight computed at run time gets, and what FoldConstant used to run)."""
    import tvm
    from tvm import te

    from edgetune.frontend.winograd import winograd_weight_transform, winograd_weight_values

    weight = np.random.default_rng(tile).standard_normal((3, 3, 5, 7)).astype(np.float32)  # HWIO
    placeholder = te.placeholder(weight.shape, "float32", name="weight")
    kernel = tvm.compile(te.create_prim_func([placeholder, winograd_weight_transform(placeholder, tile)]),
                         target="llvm")
    packed = tvm.runtime.tensor(np.zeros((tile + 2, tile + 2, 7, 5), np.float32))
    kernel(tvm.runtime.tensor(weight), packed)
    ours = winograd_weight_values(weight, tile)
    assert ours.dtype == np.float32 and ours.shape == packed.shape
    np.testing.assert_allclose(ours, packed.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_tuned_winograd_kernel_compiles_into_a_model_that_matches_onnx_runtime(block, tmp_path) -> None:
    """MetaSchedule's winograd rules tune the kernel, and compile finds its record, applies it to both
    twins and packs the transformed weights at compile time."""
    import tvm

    from edgetune.compile import compile_model
    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import run
    from edgetune.tuning.database.store import RecordStore
    from edgetune.tuning.tune import TuningPlan, tune

    profile = resolve_profile("host", None)
    target = profile.tvm_target()
    policy = _policy("host")
    tasks = extract_tasks(fuse_for_tuning(to_relax(block), target, policy), target)
    winograd = [t for t in tasks if "winograd" in t.name][:1]
    store = RecordStore(tmp_path / "records")
    plan = TuningPlan(trials_per_task=2, time_budget_s=None, search="evolutionary", seed=0,
                      cores=profile.hardware.cores or 1)
    result = tune(winograd, target, store, plan)
    assert result.tasks[0].best_us is not None, "no valid winograd schedule measured"

    with target, store.database, tvm.transform.PassContext(opt_level=3):
        applied = tvm.relax.transform.MetaScheduleApplyDatabase()(fuse_for_tuning(to_relax(block), target, policy))
    scheduled = [gvar.name_hint for gvar, func in applied.functions.items()
                 if isinstance(func, tvm.tirx.PrimFunc) and func.attrs and func.attrs.get("tirx.is_scheduled")]
    # compile fuses as tuning did, so the record is found, and replayed on the task's twin too
    assert winograd[0].weight == 2 and len(scheduled) == 2, scheduled
    assert winograd[0].name in scheduled and all("winograd" in name for name in scheduled), scheduled

    x = block.sample_inputs(seed=5)
    vm = tvm.relax.VirtualMachine(compile_model(to_relax(block), target, store.database, policy), tvm.cpu())
    expected = ReferenceRuntime(block)._session(1).run(None, x)[0]
    np.testing.assert_allclose(run(vm, [x["data"]], tvm.cpu())[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size, in_channels, out_channels, tile", [(28, 64, 64, 4), (14, 24, 40, 2), (7, 16, 16, 4)])
def test_each_thread_runs_the_whole_winograd_chain_on_its_own_tiles(size, in_channels, out_channels, tile) -> None:
    """In every design space of a Winograd kernel (whole tiles or tiles cut by the edge, channels of 16 lanes or
    not) each stage from the input tiles to the inverse transform is computed under one parallel loop over blocks
    of tile positions, so no thread reads what another wrote; and the kernel computes the convolution."""
    import tvm
    from tvm import te, topi
    from tvm.s_tir import meta_schedule as ms

    from edgetune.frontend.winograd import winograd_conv2d_nhwc, winograd_weight_values
    from edgetune.tuning.intrinsics import register_tensor_intrinsics

    data = te.placeholder((1, size, size, in_channels), name="data")
    packed = te.placeholder((tile + 2, tile + 2, out_channels, in_channels), name="packed")
    out = topi.nn.relu(winograd_conv2d_nhwc(data, packed, [1, 1, 1, 1], "float32"))
    mod = tvm.IRModule({"main": te.create_prim_func([data, packed, out])})
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    register_tensor_intrinsics(target)  # else the context imports every backend's (a minute)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, size, size, in_channels)).astype("float32")
    weight = (rng.standard_normal((3, 3, in_channels, out_channels)) * 0.1).astype("float32")
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    expected = np.maximum(sum(np.einsum("bhwc,co->bhwo", padded[:, dy:dy + size, dx:dx + size], weight[dy, dx])
                              for dy in range(3) for dx in range(3)), 0)
    for seed in range(2):
        context = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply",
                                 search_strategy="evolutionary", rand_state=seed)
        (sch,) = context.space_generator.generate_design_space(mod)
        stages = ("input_tile", "data_pack_rows", "data_pack", "bgemm", "inverse_rows", "inverse")
        outer = {sch.get(sch.get_loops(sch.get_sblock(name))[0]) for name in stages}
        assert len(outer) == 1 and next(iter(outer)).kind == tvm.tirx.ForKind.PARALLEL, sch.mod.script()
        assert all(postproc.apply(sch) for postproc in context.space_generator.postprocs)
        kernel = tvm.compile(sch.mod, target=target)
        result = tvm.runtime.tensor(np.zeros(expected.shape, "float32"))
        kernel["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(winograd_weight_values(weight, tile)), result)
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-4, atol=1e-4)
