"""Winograd convolution for 3x3, stride-1 convolutions on channels-last CPU targets.

F(m x m, 3 x 3) computes an m x m output tile with (m + 2)^2 multiplications per input/output
channel pair instead of 9 m^2: for m = 4, 36 instead of 144. The weight transform depends only on
the weights, which are constants: it is emitted as a kernel of its own that FoldConstant evaluates
at compile time, and the tuned kernel reads the transformed weights (TVM's own "pre-computed" flow
was removed from topi, which now raises "LEGACY-FLOW"). The kernel's stages are scheduled together by a
MetaSchedule custom rule of edgetune's (FUSED_RULE, `s_tir.meta_schedule.cpu.*`), its epilogue by
MetaSchedule's own rules; nothing here is x86 specific.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tvm import te

WINOGRAD_TILES = (2, 4)
"""Output tiles m of F(m x m, 3 x 3) to choose from: 4 cuts the multiplications 4x, 2 cuts them 2.25x
with 2.25x smaller transformed weights; larger tiles lose float32 accuracy."""

_OUT_EWISE_FUSABLE = 4  # relax's OpPatternKind: lets FuseOps fuse bias, residual add and ReLU behind it

FUSED_RULE = "edgetune_conv2d_nhwc_winograd_fused"
"""The inverse transform's schedule rule (`register_schedule_rules`), which schedules the whole Winograd chain: one
parallel loop over blocks of tile positions, and under it, for the block's tiles, the data transform, the batched
products and the inverse transform, each thread on its own tiles from the input to the inverse transform's output
(the stages' other blocks carry the rule "None"). MetaSchedule's own rules split each stage over the threads on
another axis (tile, transform row, output channel), so a thread reads mostly what the other one wrote: on a 2-core
VM whose CPUs the hypervisor sometimes places apart (no shared L3, benchmarks/placement.py) a tuned ResNet-18 F(4x4)
56x56x64 kernel took 0.383 ms with its CPUs together and 0.691 apart (1.8x); fused, 0.350 and 0.355 (3300 rounds
of /tmp scripts, 2026-12-07, Zen 4). Its epilogue (bias, residual, ReLU, the tiles' scatter into the output) is left
to MetaSchedule's rules: a rule that reached into it would not replay on a kernel with another epilogue, which
anchor-block equality hands the same schedule."""


def transform_matrices(tile_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cook-Toom's A (inverse), B (data) and G (weight) matrices of F(m x m, 3 x 3), as numpy arrays:
    topi's own construction, the one its `winograd_transform_matrices` wraps in tensors."""
    from tvm.topi.nn.winograd_util import _cook_toom_convolution, _interpolation_points

    return _cook_toom_convolution(_interpolation_points(tile_size + 1), tile_size, 3)


class _Matrix:
    """A constant matrix read as `matrix[row, col]` inside a compute expression, where it becomes a
    select over its nonzero entries instead of a load.

    topi's `const_matrix` makes each transform matrix a stage of its own, which MetaSchedule's winograd
    rules inline. Written into the expression, there is no such stage: each kernel is one chain of
    blocks whatever its epilogue, so kernels that differ only in the epilogue (conv + ReLU, conv + residual
    add + ReLU) share one tuned schedule by MetaSchedule's anchor-block equality. Zeros leave no select.
    """

    def __init__(self, values: np.ndarray, dtype: str):
        self.values = values
        self.dtype = dtype

    def __getitem__(self, index):
        from tvm import tirx

        row, col = index
        entry = tirx.const(0.0, self.dtype)
        for (i, j), value in np.ndenumerate(self.values):
            if value != 0:
                entry = tirx.Select(tirx.all(row == i, col == j), tirx.const(float(value), self.dtype), entry)
        return entry


def winograd_weight_transform(weight: te.Tensor, tile_size: int) -> te.Tensor:
    """HWIO 3x3 weights -> (alpha, alpha, CO, CI), alpha = tile_size + 2: G w G^T per channel pair."""
    from tvm import te
    from tvm.topi.utils import get_const_tuple

    kh, kw, ci, co = get_const_tuple(weight.shape)
    alpha = tile_size + kh - 1
    g = _Matrix(transform_matrices(tile_size)[2], str(weight.dtype))
    r_kh = te.reduce_axis((0, kh), name="r_kh")
    r_kw = te.reduce_axis((0, kw), name="r_kw")
    return te.compute(
        (alpha, alpha, co, ci),
        lambda eps, nu, o, i: te.sum(weight[r_kh, r_kw, i, o] * g[eps, r_kh] * g[nu, r_kw], axis=[r_kh, r_kw]),
        name="weight_transform",
    )


def winograd_weight_values(weight: np.ndarray, tile_size: int) -> np.ndarray:
    """`winograd_weight_transform` of constant HWIO weights, in numpy (float64, cast back). FoldConstant
    compiled the transform's select chains with LLVM and ran its naive loops: about 3.4 s of each of
    ResNet-18's `fuse_for_tuning` calls on a 2-core Zen 1 VM, and each compile of the model makes one."""
    g = transform_matrices(tile_size)[2].astype(np.float64)
    packed = np.einsum("ek,nl,klio->enoi", g, g, weight.astype(np.float64), optimize=True)
    return np.ascontiguousarray(packed.astype(weight.dtype))


def winograd_conv2d_nhwc(data: te.Tensor, kernel_pack: te.Tensor, padding: Sequence[int],
                         out_dtype: str) -> te.Tensor:
    """NHWC convolution by F(m x m, 3x3) on weights already transformed by `winograd_weight_transform`
    ((m + 2) x (m + 2) x CO x CI: the tile m is read off their shape).

    The stages and their names follow topi's `conv2d_winograd_nhwc` (data_pad, input_tile, data_pack, bgemm,
    inverse), each transform in two 1-D passes (`_two_passes`); edgetune's FUSED_RULE schedules them all.
    """
    from tvm import te
    from tvm.topi.nn.pad import pad
    from tvm.topi.nn.utils import get_pad_tuple
    from tvm.topi.utils import get_const_tuple

    n, h, w, ci = get_const_tuple(data.shape)
    alpha, _, co, _ = get_const_tuple(kernel_pack.shape)
    r = 3
    m = alpha - r + 1
    pad_t, pad_l, pad_b, pad_r = get_pad_tuple(padding, (r, r))
    a_data, b_data, _ = transform_matrices(m)
    a_mat, b_mat = _Matrix(a_data, out_dtype), _Matrix(b_data, out_dtype)

    out_h = h + pad_t + pad_b - r + 1
    out_w = w + pad_l + pad_r - r + 1
    n_h, n_w = (out_h + m - 1) // m, (out_w + m - 1) // m
    tiles = n * n_h * n_w
    data_pad = pad(
        data,
        (0, pad_t, pad_l, 0),
        (0, (n_h - 1) * m + alpha - h - pad_t, (n_w - 1) * m + alpha - w - pad_l, 0),
        name="data_pad",
        attrs={"schedule_rule": "None"},
    )
    input_tile = te.compute(
        (alpha, alpha, tiles, ci),
        lambda eps, nu, p, c: data_pad[p // (n_h * n_w), ((p // n_w) % n_h) * m + eps, (p % n_w) * m + nu, c],
        name="input_tile",
        attrs={"schedule_rule": "None"},
    )
    # the whole convolution, on every stage: the kernel's anchor block (the most FLOPs) is the batched GEMM or, for
    # few output channels, a transform, and alone it would make convolutions of other inputs, padding or weights
    # look alike to anchor-block equality
    convolution = f"{n}x{h}x{w}x{ci} -> {co}, pad {pad_t} {pad_l} {pad_b} {pad_r}, F({m}x{m}, 3x3)"
    data_pack = _two_passes(input_tile, b_mat, alpha, "data_pack", convolution)
    k = te.reduce_axis((0, ci), name="ci")
    bgemm = te.compute(
        (alpha, alpha, tiles, co),
        lambda eps, nu, p, o: te.sum(data_pack[eps, nu, p, k] * kernel_pack[eps, nu, o, k], axis=[k]),
        name="bgemm",
        attrs={"schedule_rule": "None", "edgetune.winograd_convolution": convolution},
    )
    inverse = _two_passes(bgemm, a_mat, m, "inverse", convolution, FUSED_RULE)
    return te.compute(
        (n, out_h, out_w, co),
        lambda b, y, x, o: inverse[y % m, x % m, b * n_h * n_w + (y // m) * n_w + (x // m), o],
        name="conv2d_winograd",
    )


def _two_passes(tiles, matrix, size: int, name: str, convolution: str, schedule_rule: str = "None"):
    """matrix^T X matrix for each tile X (the two leading axes) of every tile position and channel, as two 1-D
    passes (`<name>_rows`: matrix^T X, then `name`): Winograd's data transform (B) and inverse transform (A). For
    F(4x4) a tile's data transform takes 312 multiply-adds per channel instead of the one 2-D pass's 676 (the
    products of B's 26 nonzero entries), its inverse 180 instead of 324; fused (FUSED_RULE), a 56x56x64 kernel's
    data transform took 0.224 ms in one pass, its whole kernel 0.333 ms in two (a Zen 4 VM, /tmp scripts)."""
    from tvm import te

    alpha, _, positions, channels = tiles.shape
    r_a = te.reduce_axis((0, alpha), "r_a")
    r_b = te.reduce_axis((0, alpha), "r_b")
    rows = te.compute(
        (size, alpha, positions, channels),
        lambda i, col, p, c: te.sum(tiles[r_a, col, p, c] * matrix[r_a, i], axis=[r_a]),
        name=f"{name}_rows",
        attrs={"schedule_rule": "None", "edgetune.winograd_convolution": convolution},
    )
    return te.compute(
        (size, size, positions, channels),
        lambda i, j, p, c: te.sum(rows[i, r_b, p, c] * matrix[r_b, j], axis=[r_b]),
        name=name,
        attrs={"schedule_rule": schedule_rule, "edgetune.winograd_convolution": convolution},
    )


@dataclass(frozen=True)
class WinogradPolicy:
    """Which 3x3 stride-1 convolutions of one device run as Winograd kernels, and with which tile.

    A roofline estimate on the device profile's peak GFLOPS and memory bandwidth, per convolution:
    max(FLOPs / peak, bytes / bandwidth) for the direct convolution and for each tile, where the bytes
    are the weights (Winograd's transformed weights are (m + 2)^2 / 9 times larger), the activations
    and Winograd's intermediates. Small feature maps with many channels (ResNet's last stage) are
    weight-bound: there the larger tile loses to the smaller one, or to the direct convolution.
    """

    peak_gflops: float
    memory_bandwidth_gbs: float

    def tile(self, batch: int, out_h: int, out_w: int, in_channels: int, out_channels: int) -> int | None:
        """The Winograd tile m to use, or None when the direct convolution is estimated faster."""
        pixels = batch * out_h * out_w
        direct = self._seconds(2.0 * 9 * pixels * in_channels * out_channels,
                               4.0 * (9 * in_channels * out_channels + pixels * (in_channels + out_channels)))
        best, best_seconds = None, direct
        for m in WINOGRAD_TILES:
            alpha = m + 2
            tiles = batch * math.ceil(out_h / m) * math.ceil(out_w / m)
            flops = (2.0 * alpha**2 * tiles * in_channels * out_channels  # the batched GEMM
                     + 4.0 * alpha**3 * tiles * in_channels  # data transform, two 1-D passes
                     + 4.0 * alpha * m * (alpha + m) * tiles * out_channels / 2)  # inverse transform
            data_bytes = 4.0 * alpha**2 * tiles * (in_channels + out_channels)  # transformed data, GEMM output
            weight_bytes = 4.0 * alpha**2 * in_channels * out_channels
            seconds = self._seconds(flops, weight_bytes + data_bytes + 4.0 * pixels * (in_channels + out_channels))
            if seconds < best_seconds:
                best, best_seconds = m, seconds
        return best

    def _seconds(self, flops: float, memory_bytes: float) -> float:
        return max(flops / (self.peak_gflops * 1e9), memory_bytes / (self.memory_bandwidth_gbs * 1e9))

    def legalize_conv2d(self, bb, call):
        """LegalizeOps hook for relax.nn.conv2d: a weight transform + a Winograd kernel where the
        policy picks a tile, the usual legalization elsewhere. Constant weights are transformed here, in
        numpy (`winograd_weight_values`); a weight computed at run time gets the transform as a kernel."""
        import tvm

        from edgetune.frontend.constants import bound_constant

        tile = self._tile_for(call)
        if tile is None:
            return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
        weight = bound_constant(call.args[1], bb.lookup_binding)
        if weight is not None:  # computed here, where FoldConstant compiled and ran the transform
            kernel_pack = tvm.relax.const(winograd_weight_values(weight, tile), str(weight.dtype))
        else:
            kernel_pack = bb.emit_te(winograd_weight_transform, call.args[1], tile,
                                     primfunc_name_hint="winograd_weight_transform")
        out_dtype = call.attrs.out_dtype or call.args[0].ty.dtype
        return bb.call_te(
            winograd_conv2d_nhwc, call.args[0], kernel_pack, [int(p) for p in call.attrs.padding], str(out_dtype),
            primfunc_name_hint=f"conv2d_winograd_f{tile}", primfunc_attrs={"op_pattern": _OUT_EWISE_FUSABLE},
        )

    def _tile_for(self, call) -> int | None:
        """None unless a float32, 3x3, stride-1, undilated, ungrouped NHWC/HWIO convolution the
        estimate gives to Winograd."""
        attrs = call.attrs
        weight, output = call.args[1].ty, call.ty
        eligible = (
            attrs.data_layout == "NHWC"
            and attrs.kernel_layout == "HWIO"
            and (attrs.out_layout or "NHWC") == "NHWC"
            and attrs.groups == 1
            and [int(s) for s in attrs.strides] == [1, 1]
            and [int(d) for d in attrs.dilation] == [1, 1]
            and weight.dtype == "float32"
            and weight.shape is not None
            and output.shape is not None
            and [int(d) for d in weight.shape.values[:2]] == [3, 3]
        )
        if not eligible:
            return None
        batch, out_h, out_w, out_channels = (int(d) for d in output.shape.values)
        return self.tile(batch, out_h, out_w, int(weight.shape.values[2]), out_channels)


def register_schedule_rules() -> None:
    """Make FUSED_RULE known to MetaSchedule's custom-rule lookup in this process (again: no harm). Done when this
    module is imported; the tuning imports it too, as its worker processes receive the kernels already made."""
    import tvm

    tvm.register_global_func(f"s_tir.meta_schedule.cpu.{FUSED_RULE}", _schedule_fused, override=True)


def _schedule_fused(sch, inverse) -> list:
    """FUSED_RULE: the tile positions split three ways (sampled): blocks in parallel, then the block's tiles in
    register rows of the batched products. Under each block: the data transform and inverse transform per tile and
    channel vector (`_two_passes_per_vector`), the batched products per transform element as a register tile of
    tile rows x output channels (sampled) over the input channels."""
    inverse_rows = _only_producer(sch, inverse)
    bgemm = _only_producer(sch, inverse_rows)
    data_pack = _only_producer(sch, bgemm)
    data_rows = _only_producer(sch, data_pack)
    input_tile = _only_producer(sch, data_rows)
    sch.compute_inline(_only_producer(sch, input_tile))  # the padding, read where the tiles are gathered
    i, j, position, channel, r_b = sch.get_loops(inverse)
    factors = sch.sample_perfect_tile(position, n=3, max_innermost_factor=8)
    outer, block_rows, register_rows = sch.split(position, factors)
    sch.reorder(outer, block_rows, register_rows, i, j, channel, r_b)
    _two_passes_per_vector(sch, inverse, inverse_rows, sch.fuse(block_rows, register_rows))
    for stage in (bgemm, data_pack):  # each under the loop of its consumer's block, consumers first
        sch.compute_at(stage, outer, preserve_unit_loops=True)
    tile_loop = sch.get_loops(data_pack)[3]
    channel_outer = _two_passes_per_vector(sch, data_pack, data_rows, tile_loop)
    sch.compute_at(input_tile, channel_outer, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(input_tile)[-1])
    _register_tiles(sch, bgemm, factors[2])
    sch.parallel(outer)
    return [sch]


def _two_passes_per_vector(sch, second, first, tile_loop):
    """Under `tile_loop` (one tile per iteration): the channels split into vectors and, per vector, both 1-D passes
    unrolled, the first pass's (size x alpha) vectors in a local buffer and each output vector summed in a register
    (`_two_passes`). Returns the loop over the channel vectors."""
    tile = sch.get(tile_loop)
    i, j, channel, r_b = (loop for loop in sch.get_loops(second)[1:] if not sch.get(loop).same_as(tile))
    lanes = _lanes(sch.get(channel).extent)
    channel_outer, channel_inner = sch.split(channel, [None, lanes])
    sch.reorder(tile_loop, channel_outer, i, j, r_b, channel_inner)
    sch.compute_at(first, channel_outer, preserve_unit_loops=True)
    sch.set_scope(first, 0, "local")
    f_i, f_j, f_tile, f_channel, f_r = sch.get_loops(first)[-5:]
    sch.reorder(f_i, f_j, f_tile, f_r, f_channel)
    sch.vectorize(f_channel)
    sch.vectorize(channel_inner)
    for loop in (f_i, f_j, f_r, i, j, r_b):
        sch.unroll(loop)
    register = sch.cache_write(second, 0, "local")
    sch.reverse_compute_at(register, j, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(register)[-1])
    return channel_outer


def _register_tiles(sch, bgemm, register_rows) -> None:
    """Each transform element's product of the block's tiles by the transformed weights, in register tiles of
    `register_rows` tiles x a sampled number of output channels (vectorized), summed over the input channels in
    local registers. The weights are a layout-free buffer: MetaSchedule's RewriteLayout lays them out for this
    loop order at compile time."""
    *_, eps, nu, tile, channel, reduction = sch.get_loops(bgemm)
    tile_outer, tile_inner = sch.split(tile, [None, register_rows])
    channel_outer, channel_inner = sch.split(
        channel, sch.sample_perfect_tile(channel, n=2, max_innermost_factor=64))
    sch.reorder(eps, nu, tile_outer, channel_outer, reduction, tile_inner, channel_inner)
    sch.vectorize(channel_inner)
    sch.unroll(tile_inner)
    accumulator = sch.cache_write(bgemm, 0, "local")
    sch.reverse_compute_at(accumulator, channel_outer, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(accumulator)[-1])


def _lanes(channels) -> int:
    """The channel vector of the transforms: 16 float32 lanes (one AVX-512 register, two or four of narrower
    ones), or the largest power of two dividing the channels."""
    count = int(channels)
    return next(lanes for lanes in (16, 8, 4, 2, 1) if count % lanes == 0)


def _only_producer(sch, block):
    """The block's one producer that reads anything, producers that read nothing (constants) inlined, as
    MetaSchedule's winograd rules take it."""
    producers = []
    for producer in sch.get_producers(block):
        if sch.get(producer).reads:
            producers.append(producer)
        else:
            sch.compute_inline(producer)
    if len(producers) != 1:
        raise ValueError(f"a winograd stage with {len(producers)} producers that read memory, expected one")
    return producers[0]


register_schedule_rules()
