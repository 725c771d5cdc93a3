"""Weights packed into a tuned kernel's layout, computed in numpy at compile time.

Where a tuned schedule rewrites a weight's layout, relax's `SplitLayoutRewritePreproc` splits the packing
out of the kernel into a `*_weight_prepack` function called on the constant weights, and FoldConstant then
folds each such call by compiling the function with LLVM and running it: on a 2-core Zen 1 VM MobileNet-V2's
31 packings took 6.6 s of every compile of the model. A packing only moves values (`out[f(i)] = in[g(i)]`
under plain loops), so it is evaluated here as numpy index arithmetic. Anything else a function does (a
padding branch, an arithmetic op, a reduction, a symbolic extent) leaves its call to FoldConstant, as before,
and so does a copy that writes an element twice. Elements a copy leaves unwritten (a packed layout's padding)
are zero, where FoldConstant's constants held whatever the allocation held, so that two compiles of the same
records gave different libraries.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

# Index grids are built in pieces of at most this many points: a fully connected layer's weight may hold
# hundreds of millions of elements, and every index expression is an int64 array the grid's size.
GRID_CHUNK_POINTS = 1 << 20
# Past this many chunks (a loop nest whose innermost loop alone exceeds a chunk, taken a value at a time in
# Python) its call is left to FoldConstant.
MAX_GRID_CHUNKS = 4096


class _NotACopy(Exception):
    """The function does something other than a plain copy of its inputs into its outputs."""


def fold_weight_packing(mod: Any) -> Any:
    """`mod` with every `call_tir` of a copy-only PrimFunc on constant arguments replaced by the constants
    it computes, and the PrimFuncs no longer called removed (FoldConstant left them to be compiled into the
    library, unused)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from edgetune.frontend.constants import bound_constant

    call_tir = tvm.ir.Op.get("relax.call_tir")
    folded_functions: set = set()

    @mutator
    class FoldCopies(PyExprMutator):
        def visit_call_(self, original):
            call = super().visit_call_(original)
            if call.op != call_tir or not isinstance(call.args[0], tvm.ir.GlobalVar):
                return call
            function = mod[call.args[0]]
            arguments = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else None
            if not isinstance(function, tvm.tirx.PrimFunc) or arguments is None or len(call.args) > 2:
                return call
            values = [bound_constant(argument, self.lookup_binding) for argument in arguments]
            if any(value is None for value in values):
                return call
            outputs = evaluate_copy(function, values)
            if outputs is None:
                return call
            folded_functions.add(call.args[0])
            constants = [relax.const(output, str(output.dtype)) for output in outputs]
            return relax.Tuple(constants) if isinstance(original.ty, relax.TupleType) else constants[0]

    folded = tvm.IRModule(mod.functions, attrs=mod.attrs, global_infos=mod.global_infos)
    for gvar, function in mod.functions.items():
        if isinstance(function, relax.Function):
            folded[gvar] = FoldCopies().visit_expr(function)
    still_called = {gvar for function in folded.functions.values() if isinstance(function, relax.Function)
                    for gvar in relax.analysis.all_global_vars(function)}
    for gvar in folded_functions - still_called:
        del folded[gvar]
    return folded


def evaluate_copy(function: Any, inputs: list[np.ndarray]) -> list[np.ndarray] | None:
    """The outputs of a PrimFunc that copies elements of its inputs into its outputs, run on `inputs` (its
    first parameters; the rest are its outputs); None where it is not such a copy or writes an output element
    twice. Elements it leaves unwritten (a packed layout's padding: 96 channels in two blocks of 64) are
    zero, where the compiled function left whatever the allocation held."""
    params = list(function.params)
    if len(inputs) >= len(params):
        return None
    try:
        for param, value in zip(params, inputs, strict=False):
            if _static_shape(param) != value.shape or str(param.dtype) != str(value.dtype):
                return None
        sources = {param: value for param, value in zip(params, inputs, strict=False)}
        outputs = {param: _Output(_static_shape(param), str(param.dtype)) for param in params[len(inputs):]}
        for store, block_vars, points in _copies(function.body, []):
            _run_copy(store, block_vars, points, sources, outputs)
    except _NotACopy:
        return None
    if any(output.writes != np.count_nonzero(output.written) for output in outputs.values()):
        return None  # some element written twice: which write wins is the loops' order, not numpy's
    return [output.values for output in outputs.values()]


class _Output:
    """An output buffer being filled: its values, which elements were written, and how many writes."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.values = np.zeros(shape, dtype=dtype)
        self.written = np.zeros(shape, dtype=bool)
        self.writes = 0


def _static_shape(param: Any) -> tuple[int, ...]:
    import tvm

    shape = getattr(param, "shape", None)
    if shape is None or not all(isinstance(dim, tvm.tirx.IntImm) for dim in shape):
        raise _NotACopy
    return tuple(int(dim) for dim in shape)


def _copies(stmt: Any, loops: list) -> Iterator[tuple[Any, dict, int]]:
    """Each element copy under `stmt` (its BufferStore) with the index grid of the loops around it, one chunk
    at a time: each block variable's values (broadcastable arrays) and the chunk's number of points."""
    import tvm
    from tvm import s_tir

    if isinstance(stmt, tvm.tirx.SeqStmt):
        for part in stmt:
            yield from _copies(part, loops)
    elif isinstance(stmt, tvm.tirx.For):
        if stmt.thread_binding is not None or (stmt.step is not None and not _is_int(stmt.step, 1)):
            raise _NotACopy
        yield from _copies(stmt.body, [*loops, (stmt.loop_var, _int(stmt.min), _int(stmt.extent))])
    elif isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        if not _is_int(stmt.predicate, 1) or block.init is not None or len(block.alloc_buffers) or len(
                block.match_buffers):
            raise _NotACopy
        if not block.iter_vars:  # the root block
            yield from _copies(block.body, loops)
            return
        if not isinstance(block.body, tvm.tirx.BufferStore):
            raise _NotACopy
        for grid, points in _grid_chunks(loops):
            yield block.body, {iter_var.var: _index(value, grid)
                               for iter_var, value in zip(block.iter_vars, stmt.iter_values, strict=True)}, points
    else:
        raise _NotACopy


def _grid_chunks(loops: list) -> Iterator[tuple[dict, int]]:
    """The loops' variables over their ranges as broadcastable int64 arrays, with the points, in chunks of about
    GRID_CHUNK_POINTS points: the innermost loops whole, the next one in blocks of values, the outer ones one
    value at a time."""
    extents = [extent for _, _, extent in loops]
    split = len(loops)
    while split > 0 and int(np.prod(extents[split - 1:])) <= GRID_CHUNK_POINTS:
        split -= 1
    if split == 0:
        yield _grid(loops, [start for _, start, _ in loops], extents), int(np.prod(extents))
        return
    block = max(1, GRID_CHUNK_POINTS // int(np.prod(extents[split:])))
    _, partial_start, partial_extent = loops[split - 1]
    outer = loops[:split - 1]
    if int(np.prod(extents[:split - 1])) * -(-partial_extent // block) > MAX_GRID_CHUNKS:
        raise _NotACopy
    for outer_values in itertools.product(*(range(start, start + extent) for _, start, extent in outer)):
        for first in range(partial_start, partial_start + partial_extent, block):
            chunk = [1] * len(outer) + [min(block, partial_start + partial_extent - first)] + extents[split:]
            yield _grid(loops, [*outer_values, first, *(start for _, start, _ in loops[split:])], chunk), int(
                np.prod(chunk))


def _grid(loops: list, starts: list[int], extents: list[int]) -> dict:
    """Each loop variable's values over [start, start + extent), as int64 arrays broadcast against each other."""
    values = np.indices(extents, dtype=np.int64, sparse=True) if loops else ()
    return {var: axis + start for (var, _, _), axis, start in zip(loops, values, starts, strict=True)}


def _run_copy(store: Any, block_vars: dict, points: int, sources: dict, outputs: dict) -> None:
    """One chunk of a copy, through flat indices (a gather and a scatter over 1-D views)."""
    import tvm

    load = store.value
    if not isinstance(load, tvm.ir.expr.TensorLoad) or store.buffer not in outputs or load.source not in sources:
        raise _NotACopy
    output, source = outputs[store.buffer], sources[load.source]
    if output.values.dtype != source.dtype:
        raise _NotACopy
    write_at, read_at = np.broadcast_arrays(_flat_index(store.indices, block_vars, output.values.shape),
                                            _flat_index(load.indices, block_vars, source.shape))
    if write_at.size != points:  # a loop neither side reads: the same element written once per its values
        raise _NotACopy
    write_at = write_at.ravel()
    output.values.reshape(-1)[write_at] = np.ascontiguousarray(source).reshape(-1)[read_at.ravel()]
    output.written.reshape(-1)[write_at] = True
    output.writes += points


def _flat_index(indices: Any, block_vars: dict, shape: tuple[int, ...]) -> Any:
    """The flat (row-major) position of a buffer access; an index outside its axis is not a copy here."""
    if len(indices) != len(shape):
        raise _NotACopy
    flat, stride = np.int64(0), 1
    for index, extent in reversed(list(zip(indices, shape, strict=True))):
        values = _index(index, block_vars)
        if np.any(values < 0) or np.any(values >= extent):
            raise _NotACopy
        flat, stride = flat + values * stride, stride * extent
    return flat


def _index(expr: Any, grid: dict) -> Any:
    """An integer index expression over the grid's variables, evaluated elementwise."""
    import tvm
    from tvm.ir.prim import expr as prim

    if isinstance(expr, tvm.tirx.IntImm):
        return np.int64(expr.value)
    if isinstance(expr, tvm.tirx.Var):
        if expr not in grid:
            raise _NotACopy
        return grid[expr]
    if isinstance(expr, prim.Cast) and "int" in str(expr.dtype):
        return _index(expr.value, grid)
    operations = {prim.Add: np.add, prim.Sub: np.subtract, prim.Mul: np.multiply}
    if type(expr) in operations:
        return operations[type(expr)](_index(expr.a, grid), _index(expr.b, grid))
    if isinstance(expr, prim.FloorDiv | prim.FloorMod):
        divisor = _index(expr.b, grid)
        if np.any(divisor == 0):
            raise _NotACopy
        return (np.floor_divide if isinstance(expr, prim.FloorDiv) else np.mod)(_index(expr.a, grid), divisor)
    raise _NotACopy


def _int(expr: Any) -> int:
    import tvm

    if not isinstance(expr, tvm.tirx.IntImm):
        raise _NotACopy
    return int(expr.value)


def _is_int(expr: Any, value: int) -> bool:
    import tvm

    return isinstance(expr, tvm.tirx.IntImm) and int(expr.value) == value
