"""Reading TIR for the analyzers: blocks, their buffer accesses, their arithmetic, their loops.

`BlockInfo` describes a block independently of its loops (index expressions in its own iter
vars), which is what the design-space analysis needs once per space. `nests_from_func` is the
fallback path: it reads a concrete, post-processed candidate (every loop extent and kind known)
into one-candidate nests, for design spaces whose trace the structural analysis does not
understand. It is slower (a TIR walk per candidate) and its index coefficients for fused loops
(div/mod bindings) are approximations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import s_tir, tirx

from edgetune.tuning.analyzer.nest import BLOCK_IDX, SERIAL, THREAD_IDX, VTHREAD, Access, Nest

_BINARY_OPS = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.FloorDiv, tirx.FloorMod, tirx.Max, tirx.Min)
_COMPARISONS = (tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ, tirx.NE, tirx.And, tirx.Or)
_CALL_COST = 4.0
"""Instructions charged for an intrinsic call (exp, sqrt, ...): a few, as LLVM expands them."""

_THREAD_KINDS = {"blockIdx": BLOCK_IDX, "vthread": VTHREAD, "threadIdx": THREAD_IDX}


@dataclass
class BlockInfo:
    """A block's iteration space, accesses (affine in its iter vars) and arithmetic per iteration."""

    name: str
    axis_names: tuple[str, ...]
    axis_extent: np.ndarray  # [X]
    axis_reduce: np.ndarray  # [X] bool
    accesses: tuple[Access, ...]
    coef: np.ndarray  # [A, D, X] index coefficient of each access dim on each iter var (signed)
    offset: np.ndarray  # [A, D] constant part of each index
    base: np.ndarray  # [A, D] region extent of one iteration
    ops: float
    branch: bool


def dims_of(accesses: Sequence[Access]) -> int:
    return max(len(a.shape) for a in accesses)


def index_coefficients(expr, variables: Sequence[tirx.Var]) -> tuple[list[float], float, bool]:
    """(coefficient of each variable, constant, exact) for an index expression.

    Exact for affine expressions; `x // c` counts as x / c and `x % c` as x (the buffer extent
    bounds the span), which is what a footprint estimate needs from fused-loop bindings.
    """
    index = {v: i for i, v in enumerate(variables)}
    coefficients = [0.0] * len(variables)
    exact = True

    def walk(e, scale: float) -> float:
        nonlocal exact
        if isinstance(e, tirx.IntImm):
            return scale * int(e.value)
        if isinstance(e, tirx.Var):
            if e in index:
                coefficients[index[e]] += scale
            else:
                exact = False
            return 0.0
        if isinstance(e, tirx.Add):
            return walk(e.a, scale) + walk(e.b, scale)
        if isinstance(e, tirx.Sub):
            return walk(e.a, scale) + walk(e.b, -scale)
        if isinstance(e, tirx.Mul):
            if isinstance(e.b, tirx.IntImm):
                return walk(e.a, scale * int(e.b.value))
            if isinstance(e.a, tirx.IntImm):
                return walk(e.b, scale * int(e.a.value))
        if isinstance(e, tirx.FloorDiv) and isinstance(e.b, tirx.IntImm) and int(e.b.value) != 0:
            exact = False
            return walk(e.a, scale / int(e.b.value))
        if isinstance(e, tirx.FloorMod) and isinstance(e.b, tirx.IntImm):
            exact = False
            walk(e.a, scale)
            return 0.0
        if isinstance(e, tirx.Cast):
            return walk(e.value, scale)
        exact = False
        for child in _children(e):
            walk(child, scale)
        return 0.0

    constant = walk(expr, 1.0)
    return coefficients, constant, exact


def _children(e) -> list:
    if isinstance(e, _BINARY_OPS + _COMPARISONS):
        return [e.a, e.b]
    if isinstance(e, (tirx.Cast, tirx.Not)):
        return [e.value] if isinstance(e, tirx.Cast) else [e.a]
    if isinstance(e, tirx.Select):
        return [e.condition, e.true_value, e.false_value]
    if isinstance(e, tvm.ir.Call):
        return list(e.args)
    return []


def count_ops(stmt) -> tuple[float, bool]:
    """(arithmetic instructions per execution, has a data-dependent select) of a block body.

    A multiply feeding an add is one fused multiply-add; loads and their index arithmetic cost
    nothing here (the memory model charges loads; addresses are strength-reduced); comparisons
    of padding conditions count like arithmetic.
    """
    total = 0.0
    branch = False

    def expr(e, fused: bool = False) -> None:
        nonlocal total, branch
        if isinstance(e, (tirx.Add, tirx.Sub)):
            total += 1
            for side in (e.a, e.b):
                expr(side, fused=isinstance(side, tirx.Mul))
        elif isinstance(e, tirx.Mul):
            total += 0 if fused else 1
            expr(e.a)
            expr(e.b)
        elif isinstance(e, _BINARY_OPS + _COMPARISONS):
            total += 1
            expr(e.a)
            expr(e.b)
        elif isinstance(e, tirx.Select):
            branch = True
            total += 1
            for child in _children(e):
                expr(child)
        elif isinstance(e, tvm.ir.Call):
            if e.op.name.endswith("if_then_else"):
                branch = True
                total += 1
            else:
                total += _CALL_COST
            for child in e.args:
                expr(child)
        elif isinstance(e, (tirx.Cast, tirx.Not)):
            for child in _children(e):
                expr(child)

    def stmt_walk(s) -> None:
        if isinstance(s, tirx.BufferStore):
            expr(s.value)
        elif isinstance(s, tirx.SeqStmt):
            for child in s.seq:
                stmt_walk(child)
        elif isinstance(s, tirx.IfThenElse):
            nonlocal branch
            branch = True
            expr(s.condition)
            stmt_walk(s.then_case)
            if s.else_case is not None:
                stmt_walk(s.else_case)
        elif hasattr(s, "body"):
            stmt_walk(s.body)

    stmt_walk(stmt)
    return max(total, 1.0), branch


def block_info(block: s_tir.SBlock) -> BlockInfo:
    """Describe a leaf block: iter vars, accesses as coefficient tables, arithmetic."""
    variables = [iv.var for iv in block.iter_vars]
    accesses: list[Access] = []
    rows: list[tuple[list[list[float]], list[float], list[float]]] = []
    for regions, write in ((block.reads, False), (block.writes, True)):
        for region in regions:
            buffer = region.source
            shape = tuple(int(s) for s in buffer.shape)
            dtype = tvm.runtime.DataType(str(buffer.dtype))
            accesses.append(Access(buffer.name, shape, max(1, dtype.bits * dtype.lanes // 8), write, buffer.scope()))
            coefs, offsets, bases = [], [], []
            for r in region.region:
                c, constant, _ = index_coefficients(r.min, variables)
                coefs.append(c)
                offsets.append(constant)
                bases.append(float(int(r.extent)) if isinstance(r.extent, tirx.IntImm) else 1.0)
            rows.append((coefs, offsets, bases))
    dims = dims_of(accesses) if accesses else 1
    coef = np.zeros((len(accesses), dims, len(variables)))
    offset = np.zeros((len(accesses), dims))
    base = np.ones((len(accesses), dims))
    for a, (coefs, offsets, bases) in enumerate(rows):
        for d, (c, o, b) in enumerate(zip(coefs, offsets, bases)):
            coef[a, d] = c
            offset[a, d] = o
            base[a, d] = b
    ops, branch = count_ops(block.body)
    return BlockInfo(
        name=block.name_hint,
        axis_names=tuple(str(iv.var) for iv in block.iter_vars),
        axis_extent=np.array([float(int(iv.dom.extent)) for iv in block.iter_vars]),
        axis_reduce=np.array([int(iv.iter_type) == 2 for iv in block.iter_vars], dtype=bool),
        accesses=tuple(accesses),
        coef=coef,
        offset=offset,
        base=base,
        ops=ops,
        branch=branch,
    )


def leaf_blocks(func: tirx.PrimFunc) -> list[tuple[s_tir.SBlockRealize, list[tirx.For]]]:
    """Every block without child blocks, with the loops around it (outer to inner)."""
    found: list[tuple[s_tir.SBlockRealize, list[tirx.For]]] = []

    def walk(node, loops: list[tirx.For]) -> bool:
        """Visit `node`; True if it contains a block."""
        if isinstance(node, tirx.For):
            return walk(node.body, loops + [node])
        if isinstance(node, s_tir.SBlockRealize):
            if not walk(node.block.body, loops):
                found.append((node, loops))
            return True
        if isinstance(node, tirx.SeqStmt):
            contains = False
            for child in node.seq:
                contains |= walk(child, loops)
            return contains
        if isinstance(node, tirx.IfThenElse):
            contains = walk(node.then_case, loops)
            return (walk(node.else_case, loops) if node.else_case is not None else False) or contains
        if hasattr(node, "body") and node.body is not None:
            return walk(node.body, loops)
        return False

    walk(func.body, [])
    return found


def parallel_extent(mod: tvm.IRModule) -> int:
    """Iterations of the parallel loops around the largest block of the module's function (a schedule's
    module; 1: it runs on one core)."""
    largest, extent = -1, 1
    for _, loops in leaf_blocks(next(iter(mod.functions.values()))):
        try:
            size = math.prod(int(loop.extent) for loop in loops)
            parallel = math.prod(int(loop.extent) for loop in loops if loop.kind == tirx.ForKind.PARALLEL)
        except TypeError:  # a loop of symbolic extent: not one this reading ranks by
            continue
        if size > largest:
            largest, extent = size, parallel
    return extent


BALANCED = 0.9
"""A `core_balance` at which a parallel loop counts as keeping the cores busy: 9 iterations on 2 cores, not 7."""


def core_balance(extent: int, cores: int) -> float:
    """The share of `cores`' time a parallel loop of `extent` iterations keeps busy, each core running an equal
    chunk of whole iterations: 1.0 where they split evenly, 0.75 for 3 on 2 cores (one core waits half the
    time), 1 / cores for a single-threaded loop."""
    return extent / (cores * math.ceil(extent / cores))


def thread_share(parallel_extent: int | None, threads: int, cpu_threads: int) -> float:
    """What a kernel's time on `threads` is multiplied by to give its time on the target's `cpu_threads`: each
    thread runs an equal chunk of whole iterations of its parallel loop (`core_balance`), so a single-threaded
    kernel (extent 1) takes as long on both, and 7 iterations on 2 threads take 4/7 of their time on one. Scaled
    as if they split evenly (threads / cpu_threads), a build beside a busy program took a single-threaded
    candidate for twice as fast as it runs (`parallel_extent` None: unknown, scaled so)."""
    if parallel_extent is None:
        return threads / cpu_threads
    return (threads * core_balance(parallel_extent, threads)) / (cpu_threads * core_balance(parallel_extent,
                                                                                            cpu_threads))


def iter_kind(loop_var: tirx.Var, realize: s_tir.SBlockRealize) -> bool:
    """True if `loop_var` feeds a reduction iter var of the block."""
    for iv, value in zip(realize.block.iter_vars, realize.iter_values):
        if int(iv.iter_type) == 2:
            coefs, _, _ = index_coefficients(value, [loop_var])
            if coefs[0] != 0:
                return True
    return False


def nests_from_func(func: tirx.PrimFunc) -> list[Nest]:
    """Fallback: one-candidate nests of a concrete, post-processed function (a TIR walk).

    Used for design spaces the structural analysis cannot read; loop kinds (parallel,
    vectorized, unrolled, thread bindings) and unroll pragmas are taken as the function has them.
    """
    nests = []
    for realize, loops in leaf_blocks(func):
        info = block_info(realize.block)
        if not info.accesses:
            continue
        loop_vars = [f.loop_var for f in loops]
        binding = np.zeros((len(info.axis_names), len(loops)))
        for x, value in enumerate(realize.iter_values):
            coefs, _, _ = index_coefficients(value, loop_vars)
            binding[x] = np.abs(coefs)
        coef = np.abs(np.einsum("adx,xl->adl", info.coef, binding))
        unroll = 0
        for f in loops:
            step = f.annotations.get("pragma_auto_unroll_max_step") if f.annotations else None
            if step is not None:
                unroll = max(unroll, int(step))
        kinds = [int(f.kind) for f in loops]
        thread = [
            _THREAD_KINDS.get(str(f.thread_binding.thread_tag).split(".")[0], SERIAL)
            if f.thread_binding is not None
            else SERIAL
            for f in loops
        ]
        nests.append(
            Nest(
                name=info.name,
                ext=np.array([[float(int(f.extent)) for f in loops]]).reshape(1, len(loops)),
                reduce=np.array([iter_kind(v, realize) for v in loop_vars], dtype=bool),
                group=np.arange(len(loops)),
                coef=coef[None],
                base=info.base,
                accesses=info.accesses,
                ops=np.array([info.ops]),
                active=np.array([True]),
                parallel=np.array([[k == int(tirx.ForKind.PARALLEL) for k in kinds]], dtype=bool).reshape(1, -1),
                vector=np.array([[k == int(tirx.ForKind.VECTORIZED) for k in kinds]], dtype=bool).reshape(1, -1),
                unroll=np.array([float(unroll)]),
                thread=np.array(thread, dtype=int),
                coop_lanes=np.zeros(1),
                team=np.ones(1),
            )
        )
    return nests
