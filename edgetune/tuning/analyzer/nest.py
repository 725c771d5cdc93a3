"""Loop nests as numpy arrays: the vocabulary shared by the CPU and GPU analyzers.

A `Nest` is one statement (a leaf block with the loops around it) of N candidate programs at
once: loop extents, index coefficients of every buffer access on every loop, and what the
schedule did to each loop (parallel, vectorized, unrolled, bound to a GPU thread axis). Both
ways of building nests produce this form: from a design space's decisions (many candidates,
`space.py`) and from a concrete TIR function (one candidate, `tir.py`), so the cost formulas
are written once. Everything here is vectorized over the candidate axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SERIAL, BLOCK_IDX, VTHREAD, THREAD_IDX = 0, 1, 2, 3
"""GPU binding of a loop (`Nest.thread`)."""


@dataclass(frozen=True)
class Access:
    """A buffer a statement reads or writes, and where that buffer lives."""

    buffer: str
    shape: tuple[int, ...]
    elem_bytes: int
    write: bool
    scope: str  # "global", "shared", "local", ...


@dataclass
class Nest:
    """One statement of N candidates. L loops outer to inner, A accesses, D buffer dims (padded).

    Fused loops are kept as consecutive *virtual* loops with the same `group` (one per fused
    component), so footprints stay exact; parallel/vector/thread extents multiply over a group.
    """

    name: str
    ext: np.ndarray  # [N, L] loop extents (1 for loops a candidate does not have)
    reduce: np.ndarray  # [L] bool: the loop walks a reduction axis of this statement
    group: np.ndarray  # [L] int: physical loop of each virtual loop
    coef: np.ndarray  # [N, A, D, L] |index step| of each access dim per loop iteration
    base: np.ndarray  # [A, D] extent of one iteration's region (>= 1)
    accesses: tuple[Access, ...]
    ops: np.ndarray  # [N] arithmetic instructions per iteration, a multiply-add counted once
    active: np.ndarray  # [N] bool: the statement exists in that candidate (not inlined)
    parallel: np.ndarray  # [N, L] bool
    vector: np.ndarray  # [N, L] bool
    unroll: np.ndarray  # [N] auto-unroll max steps (0: none)
    thread: np.ndarray  # [L] int: SERIAL / BLOCK_IDX / VTHREAD / THREAD_IDX
    coop_lanes: np.ndarray  # [N] GPU cooperative copy vector width; 0 when not a cooperative copy
    team: np.ndarray  # [N] GPU threads sharing a cooperative copy's iterations (1 otherwise)
    own_start: int = 0  # first loop that is the statement's own (earlier ones belong to its anchor)
    versions: int = 1  # GPU shared-buffer copies kept in flight by software pipelining
    thread_bounds: tuple[int, int] = (1, 1 << 30)  # GPU threads per block the schedule requires

    @property
    def size(self) -> int:
        return self.ext.shape[0]

    @property
    def dim_size(self) -> np.ndarray:
        """[A, D] buffer extents, 1 on padding dims."""
        dims = max((len(a.shape) for a in self.accesses), default=1)
        return np.array([list(a.shape) + [1] * (dims - len(a.shape)) for a in self.accesses],
                        dtype=float).reshape(len(self.accesses), dims)

    @property
    def elem_bytes(self) -> np.ndarray:
        return np.array([a.elem_bytes for a in self.accesses], dtype=float)

    @property
    def writes(self) -> np.ndarray:
        return np.array([a.write for a in self.accesses], dtype=bool)


@dataclass
class NestGeometry:
    """What every cost formula needs about a nest's data movement, computed once per evaluation."""

    footprint: np.ndarray  # [N, A, L+1] elements of each access touched by loops p.. (p = L: one iteration)
    count: np.ndarray  # [N, L+1] executions of the sub-nest starting at loop p
    reuse: np.ndarray  # [N, A, L+1] executions of that sub-nest in a row that touch the same data
    span: np.ndarray  # [N, A, D, L+1] index range of each access dim over loops p..


def geometry(nest: Nest) -> NestGeometry:
    """Footprints, execution counts and reuse runs for every loop boundary of every candidate."""
    n, loops = nest.ext.shape
    ext = nest.ext.astype(np.float32)
    steps = nest.coef.astype(np.float32) * (ext[:, None, None, :] - 1.0)
    span = np.empty(steps.shape[:-1] + (loops + 1,), dtype=np.float32)
    span[..., -1] = 0.0
    np.cumsum(steps[..., ::-1], axis=-1, out=span[..., -2::-1])
    span += nest.base.astype(np.float32)[None, :, :, None]
    np.minimum(span, nest.dim_size.astype(np.float32)[None, :, :, None], out=span)
    footprint = np.prod(span, axis=2)
    count = np.ones((n, loops + 1))
    np.cumprod(nest.ext, axis=1, out=count[:, 1:])
    # reuse[p]: executions in a row of the sub-nest at p that see the same data = product of the
    # loops between the innermost loop (outside p) that indexes the access and p.
    touches = (nest.coef > 0).any(axis=2)  # [N, A, L]
    marks = np.where(touches, np.arange(1, loops + 1), 0)
    last = np.concatenate([np.zeros(marks.shape[:-1] + (1,), dtype=marks.dtype),
                           np.maximum.accumulate(marks, axis=-1)], axis=-1)  # [N, A, L+1]
    reuse = count[:, None, :] / np.take_along_axis(np.broadcast_to(count[:, None, :], last.shape), last, axis=-1)
    return NestGeometry(footprint, count, reuse, span)


def traffic(
    geo: NestGeometry,
    access_bytes: np.ndarray,
    capacity: np.ndarray | float,
    start: np.ndarray | None = None,
) -> np.ndarray:
    """[N, A] elements each access moves into a storage level of `capacity` bytes.

    The outermost sub-nest whose working set fits stays resident for one execution; data an
    access reuses across the executions right outside it (loops that do not index the access)
    is loaded once per run of such executions. `start` forbids sub-nests outer than a loop
    (e.g. registers only hold what fully unrolled code touches).
    """
    working_set = np.einsum("nap,a->np", geo.footprint, access_bytes)
    n, bounds = working_set.shape
    fits = working_set <= np.broadcast_to(np.asarray(capacity, dtype=float), (n,))[:, None]
    if start is not None:
        fits &= np.arange(bounds)[None, :] >= start[:, None]
    fits[:, -1] = True
    outer = np.argmax(fits, axis=1)
    rows = np.arange(n)
    fp = geo.footprint[rows, :, outer]
    executions = geo.count[rows, outer][:, None] / geo.reuse[rows, :, outer]
    return fp * executions


def grouped_extent(nest: Nest, mask: np.ndarray) -> np.ndarray:
    """[N] product of the extents of the loops selected by `mask` ([N, L] or [L])."""
    return np.prod(np.where(mask, nest.ext, 1.0), axis=1)
