"""A design space's structure, read once, so its decisions can be scored by the thousand.

MetaSchedule's design space is a trace whose sampling instructions (SamplePerfectTile,
SampleCategorical, SampleComputeLocation) hold *decisions*. `SpaceModel.analyze` replays the
trace once and reads, from its instructions and the resulting TIR:

- which block axis each loop splits, with its extent and stride as a product of tile factors;
- the loop order of each multi-level-tiled block ("anchor") and GPU thread bindings;
- blocks attached to an anchor (compute_at / reverse_compute_at, cache reads and writes,
  sampled compute locations) and the buffer that connects them, so their loop extents follow
  from the anchor's tiles (region analysis);
- the root annotations `RewriteParallelVectorizeUnroll` acts on (meta_schedule.parallel,
  .vectorize, .unroll_explicit) and GPU cooperative-fetch widths.

A decision vector is one integer per sampling instruction (an index into the slot's table of
perfect tilings, categorical candidates or compute locations). `SpaceModel.nests` turns a
matrix of them into `Nest` arrays, emulating the postprocessor's choice of parallel, vector and
unrolled loops, without building any schedule. `materialize` replays the chosen decisions with
TVM and runs the space generator's postprocessors, which remain the judge of validity.

Traces with instructions outside this vocabulary raise `UnsupportedSpace`; callers then score
materialized candidates with the TIR walk (`tir.nests_from_func`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import Schedule
from tvm.s_tir.schedule import Trace

from edgetune.tuning.analyzer.nest import BLOCK_IDX, SERIAL, THREAD_IDX, VTHREAD, Nest
from edgetune.tuning.analyzer.tir import BlockInfo, block_info, index_coefficients, leaf_blocks

INLINE, ROOT = -2, -1
"""SampleComputeLocation decisions that are not loops."""

_THREADS = {"blockIdx": BLOCK_IDX, "vthread": VTHREAD, "threadIdx": THREAD_IDX}
_PASSIVE = {"GetSBlock", "GetChildBlocks", "GetConsumers", "GetProducers", "Reorder", "ComputeInline",
            "ReverseComputeInline", "Unroll", "Unannotate"}
"""Instructions that change nothing the analysis tracks (the final TIR shows their effect). An explicit
`Unroll` (Winograd's transform loops) is modelled as a plain loop, as the TIR walk reads it too."""
_MAX_TILINGS = 60_000
TVM_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)
"""What TVM's FFI raises for schedule errors and dead random variables."""


class UnsupportedSpace(Exception):
    """The trace uses something the structural analysis does not model."""


# ---------------------------------------------------------------------------------------------
# Decision slots


def replay(mod: tvm.IRModule, trace: Trace, postprocs, seed: int) -> Schedule | None:
    """`trace` applied to `mod` and checked by the target's postprocessors; None if rejected."""
    return _postprocessed(mod, lambda sch: trace.apply_to_schedule(sch, remove_postproc=True), postprocs, seed)


def trace_text(trace: Trace) -> str:
    """A trace (its decisions included, its postprocessing left out) as text that crosses processes: a Trace
    itself pickles, but the unpickled one crashed TVM."""
    return str(_TO_JSON_GRAPH(trace.as_json(remove_postproc=True), None))


def replay_text(mod: tvm.IRModule, text: str, postprocs, seed: int) -> Schedule | None:
    """A trace written by `trace_text` replayed as `replay` does; None if rejected."""
    return _postprocessed(mod, lambda sch: Trace.apply_json_to_schedule(_FROM_JSON_GRAPH(text), sch), postprocs,
                          seed)


_TO_JSON_GRAPH = tvm_ffi.get_global_func("ffi.ToJSONGraphString")
_FROM_JSON_GRAPH = tvm_ffi.get_global_func("ffi.FromJSONGraphString")


def _postprocessed(mod: tvm.IRModule, apply: Callable[[Schedule], None], postprocs, seed: int) -> Schedule | None:
    sch = Schedule(mod, seed=seed % 2_147_483_646 + 1, debug_mask=0)
    try:
        apply(sch)
        # As MetaSchedule does: the trace marks where postprocessing began, so whoever replays the
        # measured trace (evolution from the database, a sibling) can drop it and postprocess anew.
        sch.enter_postproc()
        for postproc in postprocs:
            if not postproc.apply(sch):
                return None
    except TVM_ERRORS:
        return None
    return sch


def perfect_tilings(extent: int, parts: int, max_innermost: int) -> np.ndarray:
    """[K, parts] every way to write `extent` as an ordered product (innermost <= max_innermost)."""
    if extent < 1:
        raise UnsupportedSpace(f"tiling of a loop of extent {extent}")
    primes = _factorize(extent)
    per_prime = []
    for prime, power in primes.items():
        splits = [c for c in itertools.product(range(power + 1), repeat=parts) if sum(c) == power]
        per_prime.append((prime, np.array(splits, dtype=np.int64)))
    rows = np.ones((1, parts), dtype=np.int64)
    for prime, splits in per_prime:
        if len(rows) * len(splits) > _MAX_TILINGS:
            raise UnsupportedSpace(f"extent {extent} into {parts} tiles has too many tilings")
        rows = (rows[:, None, :] * prime ** splits[None, :, :]).reshape(-1, parts)
    if max_innermost > 0:
        rows = rows[rows[:, -1] <= max_innermost]
    return rows[np.lexsort(rows.T[::-1])]


def _factorize(n: int) -> dict[int, int]:
    factors: dict[int, int] = {}
    d = 2
    while d * d <= n:
        while n % d == 0:
            factors[d] = factors.get(d, 0) + 1
            n //= d
        d += 1
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def _neighbors(table: np.ndarray) -> np.ndarray:
    """[K, M] rows reached by moving one prime factor between two tile positions (-1: none)."""
    lookup = {tuple(r): i for i, r in enumerate(table.tolist())}
    primes = sorted({p for r in table.tolist() for v in r for p in _factorize(v)})
    parts = table.shape[1]
    moves = [(i, j, p) for i in range(parts) for j in range(parts) if i != j for p in primes]
    result = np.full((len(table), max(1, len(moves))), -1, dtype=np.int64)
    for m, (i, j, p) in enumerate(moves):
        movable = table[:, i] % p == 0
        moved = table.copy()
        moved[:, i] //= np.where(movable, p, 1)
        moved[:, j] *= np.where(movable, p, 1)
        for k in np.flatnonzero(movable):
            result[k, m] = lookup.get(tuple(moved[k].tolist()), -1)
    return result


@dataclass
class TileSlot:
    """A SamplePerfectTile instruction: its decision is a row of `table`."""

    inst: int
    table: np.ndarray  # [K, n]
    neighbors: np.ndarray  # [K, M]

    def __post_init__(self) -> None:
        self.lookup = {tuple(r): i for i, r in enumerate(self.table.tolist())}

    @property
    def size(self) -> int:
        return len(self.table)

    def values(self, idx: np.ndarray) -> np.ndarray:
        return self.table[idx].astype(float)

    def decision(self, i: int) -> list[int]:
        return [int(v) for v in self.table[i]]

    def index_of(self, decision: Any) -> int | None:
        return self.lookup.get(tuple(int(v) for v in decision))


@dataclass
class CategoricalSlot:
    """A SampleCategorical instruction: its decision indexes `candidates`."""

    inst: int
    candidates: np.ndarray
    probs: np.ndarray

    @property
    def size(self) -> int:
        return len(self.candidates)

    def values(self, idx: np.ndarray) -> np.ndarray:
        return self.candidates[idx].astype(float)[:, None]

    def decision(self, i: int) -> int:
        return int(i)

    def index_of(self, decision: Any) -> int | None:
        i = int(decision)
        return i if 0 <= i < self.size else None


@dataclass
class LocationSlot:
    """A SampleComputeLocation instruction: inline, root, or a loop position of the consumer."""

    inst: int
    choices: np.ndarray  # decision values, e.g. [-2, -1, 0, 1, ...]

    @property
    def size(self) -> int:
        return len(self.choices)

    def values(self, idx: np.ndarray) -> np.ndarray:
        return self.choices[idx].astype(float)[:, None]

    def decision(self, i: int) -> int:
        return int(self.choices[i])

    def index_of(self, decision: Any) -> int | None:
        hits = np.flatnonzero(self.choices == int(decision))
        return int(hits[0]) if len(hits) else None


Slot = TileSlot | CategoricalSlot | LocationSlot


# ---------------------------------------------------------------------------------------------
# Symbolic extents


@dataclass(frozen=True)
class Sym:
    """const * prod(slot value ** exponent): a loop extent or stride as a function of decisions."""

    const: float = 1.0
    refs: tuple[tuple[int, int, int], ...] = ()  # (slot, column, exponent)

    def __mul__(self, other: Sym) -> Sym:
        return Sym(self.const * other.const, self.refs + other.refs)

    def inverse(self) -> Sym:
        if self.const == 0:
            raise UnsupportedSpace("a split of a zero-extent loop")
        return Sym(1.0 / self.const, tuple((s, c, -e) for s, c, e in self.refs))

    def evaluate(self, values: list[np.ndarray], n: int) -> np.ndarray:
        out = np.full(n, self.const)
        for slot, column, exponent in self.refs:
            out = out * values[slot][:, column] ** exponent
        return out


@dataclass(frozen=True)
class Comp:
    """One block axis component of a loop: a split piece of `axis` with its extent and stride."""

    axis: int
    extent: Sym
    stride: Sym


@dataclass
class LoopSym:
    block: str | None  # owner of the axes; None for loops the analysis does not follow
    comps: tuple[Comp, ...] = ()
    thread: int = SERIAL

    @property
    def derived(self) -> bool:
        return self.block is None


@dataclass
class _Attach:
    loop: Any  # the LoopRV compute_at / reverse_compute_at used
    producer: bool  # compute_at (True) or reverse_compute_at (False)


# ---------------------------------------------------------------------------------------------
# Statement templates


@dataclass
class _Anchor:
    """A multi-level-tiled block: its loops are split pieces of its own axes."""

    info: BlockInfo
    loops: list[LoopSym]  # physical loops, outer to inner
    thread_bounds: tuple[int, int] = (1, 1 << 30)

    def __post_init__(self) -> None:
        self.v_axis = np.array([c.axis for loop in self.loops for c in loop.comps], dtype=int)
        self.v_ext = [c.extent for loop in self.loops for c in loop.comps]
        self.v_stride = [c.stride for loop in self.loops for c in loop.comps]
        self.group = np.array([g for g, loop in enumerate(self.loops) for _ in loop.comps], dtype=int)
        self.thread = np.array([loop.thread for loop in self.loops for _ in loop.comps], dtype=int)
        self.reduce = self.info.axis_reduce[self.v_axis]
        self.phys_reduce = np.array([bool(self.info.axis_reduce[[c.axis for c in lp.comps]].any())
                                     for lp in self.loops])

    def arrays(self, values: list[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
        """([N, Lv] extents, [N, A, D, Lv] coefficients)."""
        ext = np.stack([s.evaluate(values, n) for s in self.v_ext], axis=1)
        stride = np.stack([s.evaluate(values, n) for s in self.v_stride], axis=1)
        coef = np.abs(self.info.coef[:, :, self.v_axis])[None] * stride[:, None, None, :]
        return ext, coef


@dataclass
class _Attached:
    """A block placed inside an anchor's loops; its own loop extents are the anchor's regions."""

    info: BlockInfo
    anchor: int
    x_anchor: int  # access of the anchor to the connecting buffer
    axis_dim: np.ndarray  # [X_B] connecting-buffer dim of each of this block's axes
    fixed: int | None  # physical attach position, or None when a LocationSlot decides it
    slot: int | None
    relax: frozenset[int]  # thread kinds whose loops the region covers (GPU shared memory)
    coop: Sym | None  # cooperative fetch width (GPU)
    versions: int  # buffer copies software pipelining keeps (GPU)


@dataclass
class _Rooted:
    """A block left at the root with its original loops (nothing was decided about it but, where `slot` is
    set, whether it is inlined: a sampled location restricted to the root or inline)."""

    info: BlockInfo
    loop_axis: np.ndarray  # [L] axis of each loop
    loop_ext: np.ndarray  # [L]
    slot: int | None = None


@dataclass
class RootAnnotations:
    """What the root block asks RewriteParallelVectorizeUnroll for (max extents, unroll steps)."""

    parallel: Sym | None = None
    vectorize: Sym | None = None
    unroll: Sym | None = None


@dataclass
class SpaceModel:
    """One design space, ready to turn decision vectors into nests."""

    space: Schedule
    slots: list[Slot]
    anchors: list[_Anchor]
    attached: list[_Attached]
    rooted: list[_Rooted]
    root_ann: RootAnnotations
    inlinable: dict[int, bool] = field(default_factory=dict)
    location_allowed: dict[int, np.ndarray] = field(default_factory=dict)  # slot -> [P] bool

    # -- decision vectors -------------------------------------------------------------------

    @property
    def width(self) -> int:
        return len(self.slots)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, S] random decision vectors (tilings uniform, categoricals by their probabilities)."""
        out = np.empty((n, self.width), dtype=np.int64)
        for s, slot in enumerate(self.slots):
            if isinstance(slot, CategoricalSlot):
                out[:, s] = rng.choice(slot.size, size=n, p=slot.probs)
            else:
                out[:, s] = rng.integers(0, slot.size, size=n)
        return self.canonical(out)

    def mutate(self, rng: np.random.Generator, idx: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Change one decision per row: a tiling moves one prime factor, others take a new value."""
        out = idx.copy()
        n = len(idx)
        which = rng.choice(self.width, size=n, p=weights)
        for s, slot in enumerate(self.slots):
            rows = np.flatnonzero(which == s)
            if not len(rows):
                continue
            if isinstance(slot, TileSlot):
                options = slot.neighbors[out[rows, s]]
                valid = options >= 0
                pick = np.argmax(rng.random(options.shape) * valid, axis=1)
                moved = options[np.arange(len(rows)), pick]
                out[rows, s] = np.where(valid.any(axis=1), moved, out[rows, s])
            elif slot.size > 1:
                out[rows, s] = (out[rows, s] + rng.integers(1, slot.size, size=len(rows))) % slot.size
        return self.canonical(out)

    def mutation_weights(self) -> np.ndarray:
        """Chance of each slot being mutated: MetaSchedule's mutator mix, spread over its slots."""
        if not self.width:  # nothing to mutate: a space of one design (a transpose, a reshape)
            return np.zeros(0)
        kinds = {TileSlot: 0.9, LocationSlot: 0.05, CategoricalSlot: 0.05}
        raw = np.array([kinds[type(s)] / sum(isinstance(t, type(s)) for t in self.slots) for s in self.slots])
        raw = np.where([s.size > 1 for s in self.slots], raw, 0.0)
        return raw / raw.sum() if raw.sum() > 0 else np.full(self.width, 1.0 / self.width)

    def crossover(self, rng: np.random.Generator, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Uniform crossover; every slot is valid on its own, so any mix is a valid vector."""
        return self.canonical(np.where(rng.random(a.shape) < 0.5, a, b))

    def canonical(self, idx: np.ndarray) -> np.ndarray:
        """Replace each compute-location decision by the location TVM would actually use."""
        sampled = [a.slot for a in self.attached if a.slot is not None]
        if not sampled:
            return idx
        values = self._values(idx)
        out = idx.copy()
        for s in sampled:
            effective = self._location(s, values, len(idx))
            out[:, s] = np.searchsorted(self.slots[s].choices, effective)
        return out

    def decisions(self, row: np.ndarray) -> dict[int, Any]:
        """Instruction index -> TVM decision for one decision vector."""
        return {slot.inst: slot.decision(int(i)) for slot, i in zip(self.slots, row)}

    def encode(self, trace: Trace) -> np.ndarray | None:
        """The decision vector of a trace of this space (e.g. a measured record), or None."""
        insts = list(trace.insts)
        mine = list(self.space.trace.insts)
        if len(insts) < len(mine) or any(a.kind.name != b.kind.name for a, b in zip(insts, mine)):
            return None
        row = []
        for slot in self.slots:
            decision = trace.decisions.get(insts[slot.inst])
            i = None if decision is None else slot.index_of(decision)
            if i is None:
                return None
            row.append(i)
        return self.canonical(np.array([row], dtype=np.int64))[0]

    def materialize(self, mod: tvm.IRModule, row: np.ndarray, postprocs, seed: int) -> Schedule | None:
        """Replay the decisions with TVM and run the postprocessors; None if they reject it."""
        insts = list(self.space.trace.insts)
        decisions = {insts[i]: d for i, d in self.decisions(row).items()}
        return replay(mod, Trace(insts, decisions), postprocs, seed)

    # -- nests ------------------------------------------------------------------------------

    def _values(self, idx: np.ndarray) -> list[np.ndarray]:
        return [slot.values(idx[:, s]) for s, slot in enumerate(self.slots)]

    def _location(self, s: int, values: list[np.ndarray], n: int) -> np.ndarray:
        """[N] effective compute location of LocationSlot `s`: a physical loop, ROOT or INLINE.

        TVM keeps a decision if that loop is a valid location, else falls back to the nearest
        valid one before it; unit loops are never valid (sampling.cc, CollectComputeLocation).
        """
        wanted = values[s][:, 0].astype(np.int64)
        attached = next(a for a in self.attached if a.slot == s)
        anchor = self.anchors[attached.anchor]
        ext, _ = anchor.arrays(values, n)
        phys = np.stack([np.prod(ext[:, anchor.group == g], axis=1) for g in range(len(anchor.loops))], 1)
        allowed = self.location_allowed[s][None, :] & (phys != 1)
        positions = np.arange(phys.shape[1])[None, :]
        valid = allowed & (positions <= wanted[:, None])
        best = np.where(valid.any(axis=1), phys.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1), ROOT)
        out = np.where(wanted >= 0, best, wanted)
        if not self.inlinable.get(s, False):
            out = np.where(out == INLINE, ROOT, out)
        return out

    def nests(self, idx: np.ndarray) -> list[Nest]:
        """The statements of every candidate in `idx` ([N, S]), as nests."""
        n = len(idx)
        values = self._values(idx)
        par = self.root_ann.parallel.evaluate(values, n) if self.root_ann.parallel else None
        vec = self.root_ann.vectorize.evaluate(values, n) if self.root_ann.vectorize else None
        unroll = self.root_ann.unroll.evaluate(values, n) if self.root_ann.unroll else np.zeros(n)
        anchor_arrays = [a.arrays(values, n) for a in self.anchors]
        positions = [
            np.full(n, att.fixed) if att.fixed is not None else self._location(att.slot, values, n)
            for att in self.attached
        ]
        extra_ops = [np.zeros(n) for _ in self.anchors]
        for att, pos in zip(self.attached, positions):
            extra_ops[att.anchor] += np.where(pos == INLINE, att.info.ops, 0.0)
        nests: list[Nest] = []
        anchor_par: list[np.ndarray] = []
        for k, anchor in enumerate(self.anchors):
            ext, coef = anchor_arrays[k]
            stops = [pos for att, pos in zip(self.attached, positions) if att.anchor == k]
            parallel = _parallel_loops(ext, anchor.group, anchor.phys_reduce, anchor.thread, stops, par)
            anchor_par.append(parallel)
            nest = Nest(
                name=anchor.info.name,
                ext=ext,
                reduce=anchor.reduce,
                group=anchor.group,
                coef=coef,
                base=anchor.info.base,
                accesses=anchor.info.accesses,
                ops=anchor.info.ops + extra_ops[k],
                active=np.ones(n, dtype=bool),
                parallel=parallel,
                vector=np.zeros_like(parallel),
                unroll=unroll,
                thread=anchor.thread,
                coop_lanes=np.zeros(n),
                team=np.ones(n),
                thread_bounds=anchor.thread_bounds,
            )
            nest.vector = _vector_loops(nest, stops, vec)
            nests.append(nest)
        for att, pos in zip(self.attached, positions):
            nests.append(self._attached_nest(att, pos, anchor_arrays[att.anchor], anchor_par[att.anchor],
                                             values, n, par, vec, unroll))
        for rooted in self.rooted:
            nest = _rooted_nest(rooted, n, par, vec, unroll)
            if rooted.slot is not None:
                nest.active = values[rooted.slot][:, 0] != INLINE
            nests.append(nest)
        return nests

    def _attached_nest(self, att: _Attached, pos: np.ndarray, anchor_arrays, anchor_parallel: np.ndarray,
                       values: list[np.ndarray], n: int, par, vec, unroll) -> Nest:
        anchor = self.anchors[att.anchor]
        ext_a, coef_a = anchor_arrays
        relaxed = np.isin(anchor.thread, list(att.relax))
        shared = (anchor.group[None, :] <= pos[:, None]) & ~relaxed[None, :]
        inside = ~shared
        x = att.x_anchor
        region = 1.0 + np.einsum("ndl,nl->nd", coef_a[:, x] * inside[:, None, :], ext_a - 1.0)
        region += anchor.info.base[x][None, :] - 1.0
        x_shape = anchor.info.accesses[x].shape
        padded = np.array(list(x_shape) + [1] * (region.shape[1] - len(x_shape)), dtype=float)
        region = np.minimum(region, padded[None, :])
        own = np.minimum(region[:, att.axis_dim], att.info.axis_extent[None, :])
        info = att.info
        coef_own = np.abs(info.coef)  # [A, D, X]
        lift = coef_a[:, x][:, att.axis_dim, :]  # [N, X, Lv]: step of each own axis per anchor loop
        coef_shared = np.einsum("adx,nxl->nadl", coef_own, lift) * shared[:, None, None, :]
        coef = np.concatenate([coef_shared, np.broadcast_to(coef_own[None], (n,) + coef_own.shape)], axis=3)
        ext = np.concatenate([np.where(shared, ext_a, 1.0), own], axis=1)
        own_groups = len(anchor.loops) + np.arange(len(info.axis_names))
        group = np.concatenate([anchor.group, own_groups])
        thread = np.concatenate([anchor.thread, np.full(len(info.axis_names), SERIAL)])
        at_root = pos == ROOT
        own_par = _parallel_loops(own, np.arange(own.shape[1]), np.zeros(own.shape[1], bool),
                                  np.zeros(own.shape[1], int), [], par)
        parallel = np.concatenate([anchor_parallel & shared, own_par & at_root[:, None]], axis=1)
        nest = Nest(
            name=info.name,
            ext=ext,
            reduce=np.zeros(ext.shape[1], dtype=bool),
            group=group,
            coef=coef,
            base=info.base,
            accesses=info.accesses,
            ops=np.full(n, info.ops),
            active=pos != INLINE,
            parallel=parallel,
            vector=np.zeros_like(parallel),
            unroll=unroll,
            thread=thread,
            coop_lanes=att.coop.evaluate(values, n) if att.coop is not None else np.zeros(n),
            team=np.prod(np.where((anchor.thread == THREAD_IDX) & relaxed, ext_a, 1.0), axis=1),
            own_start=ext_a.shape[1],
            versions=att.versions,
        )
        nest.vector = _vector_loops(nest, [pos], vec, first_own=ext_a.shape[1])
        return nest

    # -- analysis ---------------------------------------------------------------------------

    @classmethod
    def analyze(cls, mod: tvm.IRModule, space: Schedule) -> SpaceModel:
        """Read a design space's structure (raises UnsupportedSpace)."""
        return _Analysis(mod, space).run()


def _parallel_loops(ext: np.ndarray, group: np.ndarray, phys_reduce: np.ndarray, thread: np.ndarray,
                    stops: list[np.ndarray], max_extent: np.ndarray | None) -> np.ndarray:
    """[N, Lv] loops RewriteParallelVectorizeUnroll fuses and parallelizes.

    Outer data-parallel loops are fused until their product exceeds the annotation or a loop
    holds more than one statement (an attach point), that loop included.
    """
    n = ext.shape[0]
    groups = int(group.max()) + 1 if len(group) else 0
    if max_extent is None or groups == 0:
        return np.zeros(ext.shape, dtype=bool)
    count = np.zeros(n, dtype=np.int64)
    going = np.ones(n, dtype=bool)
    prod = np.ones(n)
    for g in range(groups):
        members = group == g
        if phys_reduce[g] or (thread[members] != SERIAL).any():
            break
        count += going
        prod = np.where(going, prod * np.prod(ext[:, members], axis=1), prod)
        multi_child = np.zeros(n, dtype=bool)
        for stop in stops:
            multi_child |= stop == g
        going &= ~((prod > max_extent) | multi_child)
    count = np.where(prod == 1, 0, count)
    return group[None, :] < count[:, None]


def _vector_loops(nest: Nest, stops: list[np.ndarray], max_extent: np.ndarray | None, first_own: int = 0) -> np.ndarray:
    """[N, Lv] innermost loops RewriteParallelVectorizeUnroll fuses and vectorizes.

    Spatial, unbound, single-statement loops from the innermost outwards while the product stays
    within the annotation and every access stays contiguous (the postproc's stride check).
    """
    n, loops = nest.ext.shape
    result = np.zeros((n, loops), dtype=bool)
    if max_extent is None or loops == 0:
        return result
    fusible = _contiguous_loops(nest)
    count = np.zeros(n, dtype=np.int64)
    prod = np.ones(n)
    going = np.ones(n, dtype=bool)
    for l in range(loops - 1, -1, -1):
        if nest.reduce[l] or nest.thread[l] != SERIAL or np.sum(nest.group == nest.group[l]) > 1 or l < first_own:
            going[:] = False
        multi_child = np.zeros(n, dtype=bool)
        for stop in stops:
            multi_child |= stop == nest.group[l]
        going &= ~multi_child & (count < fusible)
        prod_next = prod * nest.ext[:, l]
        going &= prod_next <= max_extent
        result[:, l] = going
        prod = np.where(going, prod_next, prod)
        count += going
    result &= (prod > 1)[:, None]
    return result


def _contiguous_loops(nest: Nest) -> np.ndarray:
    """[N] how many innermost loops every access allows to fuse into one vector (stride check)."""
    n, loops = nest.ext.shape
    dim_size = nest.dim_size
    row_stride = np.concatenate([np.cumprod(dim_size[:, ::-1], axis=1)[:, ::-1][:, 1:],
                                 np.ones((dim_size.shape[0], 1))], axis=1)
    stride = np.einsum("nadl,ad->nal", nest.coef, row_stride)
    best = np.full(n, loops, dtype=np.int64)
    for a in range(stride.shape[1]):
        fusible = np.zeros(n, dtype=np.int64)
        going = np.ones(n, dtype=bool)
        prev_stride = np.zeros(n)
        prev_ext = np.zeros(n)
        used = np.zeros(n, dtype=bool)
        for l in range(loops - 1, -1, -1):
            s = stride[:, a, l]
            unused = s == 0
            first = ~unused & ~used
            ok_first = first & ~((s != 1) & (fusible != 0))
            ok_next = ~unused & used & (np.abs(s - prev_stride * prev_ext) < 0.5)
            step = going & (unused | ok_first | ok_next)
            going &= step
            fusible += step
            newly = step & ~unused
            prev_stride = np.where(newly, s, prev_stride)
            prev_ext = np.where(newly, nest.ext[:, l], prev_ext)
            used |= newly
        best = np.minimum(best, fusible)
    return best


def _rooted_nest(rooted: _Rooted, n: int, par, vec, unroll) -> Nest:
    info = rooted.info
    ext = np.broadcast_to(rooted.loop_ext[None, :], (n, len(rooted.loop_ext))).copy()
    coef = np.abs(info.coef[:, :, rooted.loop_axis])
    reduce = info.axis_reduce[rooted.loop_axis]
    loops = len(rooted.loop_ext)
    group = np.arange(loops)
    parallel = _parallel_loops(ext, group, reduce, np.zeros(loops, int), [], par)
    nest = Nest(
        name=info.name,
        ext=ext,
        reduce=reduce,
        group=group,
        coef=np.broadcast_to(coef[None], (n,) + coef.shape).copy(),
        base=info.base,
        accesses=info.accesses,
        ops=np.full(n, info.ops),
        active=np.ones(n, dtype=bool),
        parallel=parallel,
        vector=np.zeros_like(parallel),
        unroll=unroll,
        thread=np.zeros(loops, dtype=int),
        coop_lanes=np.zeros(n),
        team=np.ones(n),
    )
    nest.vector = _vector_loops(nest, [], vec)
    return nest


# ---------------------------------------------------------------------------------------------
# The analysis itself


class _Analysis:
    """One pass over a space's trace (replayed with every compute location at the root)."""

    def __init__(self, mod: tvm.IRModule, space: Schedule):
        self.mod = mod
        self.space = space
        self.slots: list[Slot] = []
        self.exprs: dict[Any, Sym] = {}
        self.loops: dict[Any, LoopSym] = {}
        self.location_of: dict[Any, int] = {}  # LoopRV from SampleComputeLocation -> slot
        self.attach: dict[str, _Attach] = {}
        self.moved: set[str] = set()
        self.root_ann = RootAnnotations()
        self.coop: dict[str, Sym] = {}
        self.fused_into: dict[Any, Any] = {}  # LoopRV -> the LoopRV a later Fuse turned it into
        self.thread_bounds: dict[str, tuple[int, int]] = {}
        self.versions = 1
        self.original_loops = _original_loop_axes(mod)

    def run(self) -> SpaceModel:
        insts = list(self.space.trace.insts)
        decisions = dict(self.space.trace.decisions.items())
        locations = [k for k, inst in enumerate(insts) if inst.kind.name == "SampleComputeLocation"]
        for k in locations:
            decisions[insts[k]] = ROOT
        sch = Schedule(self.mod, debug_mask=0)
        Trace(insts, decisions).apply_to_schedule(sch, remove_postproc=True)
        self.sch = sch
        for k, inst in enumerate(sch.trace.insts):
            self._instruction(k, inst)
        model = self._statements()
        for k in locations:
            s = next(i for i, slot in enumerate(self.slots) if slot.inst == k)
            model.inlinable[s] = _can_inline(self.mod, insts, decisions, insts[k])
            if not model.inlinable[s]:
                slot = self.slots[s]
                assert isinstance(slot, LocationSlot)
                self.slots[s] = LocationSlot(slot.inst, slot.choices[slot.choices != INLINE])
        self._check(model, sch)
        return model

    # instructions

    def _instruction(self, k: int, inst) -> None:
        name = inst.kind.name
        ins, attrs, outs = list(inst.inputs), list(inst.attrs), list(inst.outputs)
        if name in _PASSIVE:
            return
        if name == "GetLoops":
            block = self._block_name(ins[0])
            if block in self.moved or block not in self.original_loops:
                for o in outs:
                    self.loops.setdefault(o, LoopSym(None))
                return
            for o, (axis, extent) in zip(outs, self.original_loops[block]):
                self.loops[o] = LoopSym(block, (Comp(axis, Sym(float(extent)), Sym()),))
        elif name == "SamplePerfectTile":
            loop = self._loop(ins[0])
            if loop.derived or len(loop.comps) != 1 or loop.comps[0].extent.refs:
                raise UnsupportedSpace("tiling of a loop that is not an original block axis")
            extent = int(loop.comps[0].extent.const)
            table = perfect_tilings(extent, int(attrs[0]), int(attrs[1]))
            self.slots.append(TileSlot(k, table, _neighbors(table)))
            for c, o in enumerate(outs):
                self.exprs[o] = Sym(refs=((len(self.slots) - 1, c, 1),))
        elif name == "SampleCategorical":
            candidates = np.array([float(int(c)) for c in attrs[0]])
            probs = np.array([float(p) for p in attrs[1]])
            self.slots.append(CategoricalSlot(k, candidates, probs / probs.sum()))
            self.exprs[outs[0]] = Sym(refs=((len(self.slots) - 1, 0, 1),))
        elif name == "SampleComputeLocation":
            self.slots.append(LocationSlot(k, np.array([INLINE, ROOT])))  # loop choices: see _attached
            self.location_of[outs[0]] = len(self.slots) - 1
        elif name == "Split":
            self._split(ins, outs)
        elif name == "Fuse":
            for i in ins:
                self.fused_into[i] = outs[0]
            parts = [self._loop(i) for i in ins]
            if any(p.derived for p in parts) or len({p.block for p in parts}) != 1:
                self.loops[outs[0]] = LoopSym(None)
            else:
                self.loops[outs[0]] = LoopSym(parts[0].block, tuple(c for p in parts for c in p.comps))
        elif name == "Bind":
            loop = self._loop(ins[0])
            loop.thread = _THREADS.get(str(attrs[0]).split(".")[0], SERIAL)
        elif name == "Annotate":
            self._annotate(ins, attrs)
        elif name in ("CacheRead", "CacheWrite"):
            self.moved.add(self._block_name(ins[0]))
        elif name in ("ComputeAt", "ReverseComputeAt"):
            block = self._block_name(ins[0])
            self.attach[block] = _Attach(ins[1], name == "ComputeAt")
            self.moved.add(block)
        elif name == "EnterPostproc":
            return
        else:
            raise UnsupportedSpace(f"instruction {name}")

    def _split(self, ins: list, outs: list) -> None:
        parent = self._loop(ins[0])
        if parent.derived or len(parent.comps) != 1:
            for o in outs:
                self.loops[o] = LoopSym(None)
            return
        comp = parent.comps[0]
        factors: list[Sym | None] = []
        for f in ins[1:]:
            if f is None:
                factors.append(None)
            elif isinstance(f, tirx.IntImm):
                factors.append(Sym(float(int(f.value))))
            elif f in self.exprs:
                factors.append(self.exprs[f])
            else:
                raise UnsupportedSpace("split factor of unknown origin")
        if factors.count(None) > 1:
            raise UnsupportedSpace("split with several inferred factors")
        if None in factors:
            known = Sym()
            for f in factors:
                if f is not None:
                    known = known * f
            factors[factors.index(None)] = comp.extent * known.inverse()
        for k, o in enumerate(outs):
            stride = comp.stride
            for f in factors[k + 1:]:
                stride = stride * f  # type: ignore[operator]
            self.loops[o] = LoopSym(parent.block, (Comp(comp.axis, factors[k], stride),))  # type: ignore[arg-type]

    def _annotate(self, ins: list, attrs: list) -> None:
        key = str(attrs[0])
        value = ins[1]
        if isinstance(value, tirx.IntImm):
            sym: Sym | None = Sym(float(int(value.value)))
        elif isinstance(value, tirx.Var) and value in self.exprs:
            sym = self.exprs[value]
        else:
            sym = None
        target = ins[0]
        if not isinstance(target, s_tir.schedule.SBlockRV):
            if key == "software_pipeline_stage":
                self.versions = max(self.versions, 1 + max(int(v) for v in value))
            return
        block = self._block_name(target)
        if block == "root":
            if key == "meta_schedule.parallel":
                self.root_ann.parallel = sym
            elif key == "meta_schedule.vectorize":
                self.root_ann.vectorize = sym
            elif key in ("meta_schedule.unroll_explicit", "meta_schedule.unroll_implicit"):
                self.root_ann.unroll = sym
        elif key == "meta_schedule.cooperative_fetch" and sym is not None:
            self.coop[block] = sym
        elif key == "meta_schedule.thread_extent_low_inclusive" and sym is not None:
            self.thread_bounds[block] = (int(sym.const), self.thread_bounds.get(block, (1, 1 << 30))[1])
        elif key == "meta_schedule.thread_extent_high_inclusive" and sym is not None:
            self.thread_bounds[block] = (self.thread_bounds.get(block, (1, 1 << 30))[0], int(sym.const))

    def _loop(self, rv) -> LoopSym:
        if rv in self.location_of:
            raise UnsupportedSpace("a sampled compute location used as a loop")
        if rv not in self.loops:
            raise UnsupportedSpace("loop of unknown origin")
        return self.loops[rv]

    def _block_name(self, rv) -> str:
        try:
            return self.sch.get(rv).name_hint
        except TVM_ERRORS:
            return f"<removed {id(rv)}>"

    # statements

    def _statements(self) -> SpaceModel:
        func = _only_func(self.sch.mod)
        for_sym: dict[tirx.For, LoopSym] = {}
        for rv, sym in self.loops.items():
            try:
                node = self.sch.get(rv)
            except TVM_ERRORS:
                continue
            if node not in for_sym or for_sym[node].derived:
                for_sym[node] = sym
        leaves = leaf_blocks(func)
        infos = {realize.block.name_hint: block_info(realize.block) for realize, _ in leaves}
        anchors: list[_Anchor] = []
        anchor_of: dict[str, int] = {}
        anchor_loops: dict[str, list[tirx.For]] = {}
        pending: list[tuple[s_tir.SBlockRealize, list[tirx.For]]] = []
        for realize, loops in leaves:
            name = realize.block.name_hint
            syms = [for_sym.get(f) for f in loops]
            if name not in self.attach and loops and all(s is not None and s.block == name for s in syms):
                anchor_of[name] = len(anchors)
                anchor_loops[name] = loops
                bounds = self.thread_bounds.get(name, (1, 1 << 30))
                anchors.append(_Anchor(infos[name], syms, bounds))  # type: ignore[arg-type]
            else:
                pending.append((realize, loops))
        attached: list[_Attached] = []
        rooted: list[_Rooted] = []
        location_allowed: dict[int, np.ndarray] = {}
        for realize, loops in pending:
            name = realize.block.name_hint
            info = infos[name]
            slot = self.location_of.get(self.attach[name].loop) if name in self.attach else None
            if slot is not None and self._at_root_or_inline(info, infos, anchor_of):
                # no tiled block reads it (Winograd's padding and output): narrowed to the root and inline
                self.slots[slot] = LocationSlot(self.slots[slot].inst, np.array([INLINE, ROOT]))
                rooted.append(dataclasses.replace(_rooted(realize, loops, info), slot=slot))
            elif name in self.attach:
                attached.append(self._attached(name, info, infos, anchors, anchor_of, anchor_loops,
                                               location_allowed))
            elif all(f not in for_sym or for_sym[f].block == name for f in loops) and name not in self.moved:
                rooted.append(_rooted(realize, loops, info))
            else:
                raise UnsupportedSpace(f"block {name} is neither tiled, attached nor untouched")
        if not anchors and not rooted:
            raise UnsupportedSpace("no statements")
        return SpaceModel(self.space, self.slots, anchors, attached, rooted, self.root_ann,
                          location_allowed=location_allowed)

    def _at_root_or_inline(self, info: BlockInfo, infos: dict[str, BlockInfo], anchor_of: dict[str, int]) -> bool:
        """Whether a block of sampled location is modelled at the root or inlined only: its one reader is no
        tiled block but either an untouched block at the root (Winograd's output, read by the fused epilogue)
        or a block attached, at a sampled or a fixed place, that feeds one tiled block (Winograd's padding, read
        by the tile-gathering block)."""
        readers = _readers(info, infos)
        if len(readers) != 1 or readers[0] in anchor_of:
            return False
        reader = readers[0]
        if reader not in self.attach:
            return reader not in self.moved
        return len(_tiled_consumers(infos[reader], infos, anchor_of)) == 1

    def _attached(self, name: str, info: BlockInfo, infos: dict[str, BlockInfo], anchors: list[_Anchor],
                  anchor_of: dict[str, int], anchor_loops: dict[str, list[tirx.For]],
                  location_allowed: dict[int, np.ndarray]) -> _Attached:
        spec = self.attach[name]
        if info.axis_reduce.any():
            raise UnsupportedSpace(f"attached block {name} reduces")
        slot = self.location_of.get(spec.loop)
        if slot is not None:
            consumers = _tiled_consumers(info, infos, anchor_of)
            if len(consumers) != 1:
                raise UnsupportedSpace(f"sampled location of {name} without a single tiled consumer")
            anchor_name, fixed = consumers[0], None
        else:
            loop = spec.loop
            while loop in self.fused_into:
                loop = self.fused_into[loop]
            node = self.sch.get(loop)
            owners = [n for n, loops in anchor_loops.items() if node in loops]
            if len(owners) != 1:
                raise UnsupportedSpace(f"{name} is attached to a loop of no tiled block")
            anchor_name = owners[0]
            fixed = anchor_loops[anchor_name].index(node)
        anchor = anchors[anchor_of[anchor_name]]
        own_side = [i for i, a in enumerate(info.accesses) if a.write == spec.producer]
        other = {a.buffer for i, a in enumerate(info.accesses) if i in own_side}
        x_anchor = [i for i, a in enumerate(anchor.info.accesses) if a.buffer in other and a.write != spec.producer]
        if len(x_anchor) != 1:
            raise UnsupportedSpace(f"{name} and its anchor share no single buffer")
        buffer = anchor.info.accesses[x_anchor[0]].buffer
        x_own = next(i for i in own_side if info.accesses[i].buffer == buffer)
        axis_dim = _identity_dims(info.coef[x_own])
        if slot is not None:
            location_allowed[slot] = _location_rules(anchor)
            loc = self.slots[slot]
            assert isinstance(loc, LocationSlot)
            self.slots[slot] = LocationSlot(loc.inst, np.concatenate([[INLINE, ROOT], np.arange(len(anchor.loops))]))
        scope = info.accesses[x_own].scope
        relax = frozenset({THREAD_IDX, VTHREAD}) if scope.startswith("shared") else frozenset()
        return _Attached(info, anchor_of[anchor_name], x_anchor[0], axis_dim, fixed, slot, relax,
                         self.coop.get(name), self.versions if relax else 1)

    def _check(self, model: SpaceModel, sch: Schedule) -> None:
        """The symbolic extents must reproduce the replayed schedule's own loops."""
        row = []
        for slot in model.slots:
            decision = sch.trace.decisions[sch.trace.insts[slot.inst]]
            i = slot.index_of(decision)
            if i is None:
                raise UnsupportedSpace("the space's own decision is not in its table")
            row.append(i)
        values = model._values(np.array([row], dtype=np.int64))
        func = _only_func(sch.mod)
        extents = {r.block.name_hint: [int(f.extent) for f in loops] for r, loops in leaf_blocks(func)}
        for anchor in model.anchors:
            ext, _ = anchor.arrays(values, 1)
            phys = [round(float(np.prod(ext[0, anchor.group == g]))) for g in range(len(anchor.loops))]
            if phys != extents[anchor.info.name]:
                raise UnsupportedSpace(f"loop extents of {anchor.info.name} do not match the analysis")
        nests = {nest.name: nest for nest in model.nests(np.array([row], dtype=np.int64))}
        for att in model.attached:
            if att.fixed is None:
                continue
            own = np.prod(nests[att.info.name].ext[0, -len(att.info.axis_names):])
            if round(float(own)) != int(np.prod(extents[att.info.name][att.fixed + 1:])):
                raise UnsupportedSpace(f"region of {att.info.name} does not match the analysis")


def _original_loop_axes(mod: tvm.IRModule) -> dict[str, list[tuple[int, int]]]:
    """For each block of the unscheduled function: (axis, extent) of each loop around it."""
    result = {}
    for realize, loops in leaf_blocks(_only_func(mod)):
        axes = []
        variables = [iv.var for iv in realize.block.iter_vars]
        for f in loops:
            hits = [x for x, value in enumerate(realize.iter_values)
                    if isinstance(value, tirx.Var) and value.same_as(f.loop_var)]
            if len(hits) != 1:
                break
            axes.append((hits[0], int(f.extent)))
        else:
            if len(axes) == len(variables) or not variables:
                result[realize.block.name_hint] = axes
    return result


def _readers(info: BlockInfo, infos: dict[str, BlockInfo]) -> list[str]:
    """The blocks that read what the block writes."""
    own_writes = {a.buffer for a in info.accesses if a.write}
    return [n for n, other in infos.items() if any(a.buffer in own_writes and not a.write for a in other.accesses)]


def _tiled_consumers(info: BlockInfo, infos: dict[str, BlockInfo], anchor_of: dict[str, int]) -> list[str]:
    """The tiled blocks (anchors) that read what the block writes."""
    return [n for n in _readers(info, infos) if n in anchor_of]


def _rooted(realize: s_tir.SBlockRealize, loops: list[tirx.For], info: BlockInfo) -> _Rooted:
    axes = []
    for f in loops:
        coefs = [index_coefficients(v, [f.loop_var])[0][0] for v in realize.iter_values]
        hits = [x for x, c in enumerate(coefs) if c != 0]
        if len(hits) != 1 or coefs[hits[0]] != 1:
            raise UnsupportedSpace(f"untouched block {info.name} has a non-trivial binding")
        axes.append(hits[0])
    return _Rooted(info, np.array(axes, dtype=int), np.array([float(int(f.extent)) for f in loops]))


def _identity_dims(coef: np.ndarray) -> np.ndarray:
    """[X] buffer dim indexed by each axis, for an access that is a permutation of the axes."""
    dims, axes = coef.shape
    result = np.full(axes, -1, dtype=int)
    for d in range(dims):
        hits = np.flatnonzero(coef[d])
        if len(hits) > 1 or (len(hits) == 1 and coef[d, hits[0]] != 1):
            raise UnsupportedSpace("connecting access is not a copy of the block's axes")
        if len(hits) == 1:
            result[hits[0]] = d
    if (result < 0).any():
        raise UnsupportedSpace("an axis of an attached block indexes no connecting dim")
    return result


def _location_rules(anchor: _Anchor) -> np.ndarray:
    """[P] positions SampleComputeLocation may pick, before the unit-loop rule (sampling.cc)."""
    phys_reduce = anchor.phys_reduce
    spatial = ~phys_reduce
    last_spatial = int(np.flatnonzero(spatial).max()) if spatial.any() else -1
    allowed = np.zeros(len(phys_reduce), dtype=bool)
    seen_reduce = False
    for i, red in enumerate(phys_reduce):
        if not red and seen_reduce:
            break
        if red:
            seen_reduce = True
            if i > last_spatial:
                break
        allowed[i] = True
    return allowed


def _can_inline(mod: tvm.IRModule, insts: list, decisions: dict, location) -> bool:
    """Whether TVM keeps an 'inline' decision for this compute location (it can inline the block)."""
    trial = dict(decisions)
    trial[location] = INLINE
    sch = Schedule(mod, debug_mask=0)
    try:
        Trace(insts, trial).apply_to_schedule(sch, remove_postproc=True)
    except TVM_ERRORS:
        return False
    index = insts.index(location)
    kept = sch.trace.decisions.get(sch.trace.insts[index])
    return kept is not None and int(kept) == INLINE


def _only_func(mod: tvm.IRModule) -> tirx.PrimFunc:
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    if len(funcs) != 1:
        raise UnsupportedSpace("module with several functions")
    return funcs[0]
