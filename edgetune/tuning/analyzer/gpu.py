"""GPU draft model (Pruner's symbol-based analyzer, extended with MetaSchedule's structure).

Per statement, for N candidates at once, from the loops bound to blockIdx / vthread / threadIdx:

- compute: iterations x ops at the SMs' fused-multiply-add rate, scaled by how many SMs the
  grid fills (wave quantization), warp utilization (threads per block vs the warp size), and
  latency hiding (resident warps per scheduler x independent accumulators per thread);
  occupancy follows from threads, shared memory and registers per block;
- memory: global traffic (cooperative copies into shared memory, or direct loads) with
  coalescing from the stride of adjacent threads, served by L2 and, for data that does not
  stay in L2, DRAM; shared-memory loads of the tiled block from its per-thread footprint and
  register reuse;
- latency = max(compute, DRAM, L2, shared) summed over statements, plus a launch per kernel.

Candidates the device cannot run (too many threads or too much shared memory per block) get
an infinite latency: VerifyGPUCode would reject them anyway. Threads wanting more registers
than the limit are slowed in proportion (spilling to local memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgetune.profiles import Hardware
from edgetune.tuning.analyzer.nest import BLOCK_IDX, THREAD_IDX, VTHREAD, Nest, geometry, traffic

MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
MAX_REGISTERS_PER_THREAD = 255
REUSE_REGISTERS = 64
"""Registers of a thread the reuse model counts on to hold operands across loop iterations."""
SCHEDULERS_PER_SM = 4
FMA_LATENCY_CYCLES = 4.0
BASE_REGISTERS = 16
"""Registers a thread needs beyond its accumulators and operands (indices, addresses)."""
SECTOR_BYTES = 32.0
L2_OVER_DRAM_BANDWIDTH = 3.0
"""L2 bandwidth as a multiple of DRAM bandwidth (A100: ~5 TB/s vs 1.6 TB/s)."""
SHARED_BYTES_PER_CYCLE = 128.0
"""Shared-memory bandwidth per SM (32 banks x 4 bytes)."""
KERNEL_LAUNCH_S = 3e-6
DEFAULT_THREADS = 1024
"""Threads per block RewriteUnboundBlock gives a statement the schedule left unbound."""


@dataclass(frozen=True)
class GpuMachine:
    sm_count: int
    clock_hz: float
    fma_per_s: float
    max_threads_per_block: int
    shared_bytes_per_block: float
    shared_bytes_per_sm: float
    registers_per_sm: int
    warp: int
    l2_bytes: float
    dram_bytes_per_s: float

    @classmethod
    def from_hardware(cls, hw: Hardware) -> GpuMachine:
        assert hw.sm_count and hw.max_threads_per_block and hw.shared_memory_per_block_kb and hw.warp_size
        return cls(
            sm_count=hw.sm_count,
            clock_hz=hw.clock_ghz * 1e9,
            fma_per_s=(hw.peak_gflops or 0.0) * 1e9 / 2.0,
            max_threads_per_block=hw.max_threads_per_block,
            shared_bytes_per_block=hw.shared_memory_per_block_kb * 1024.0,
            shared_bytes_per_sm=max(hw.l1d_kb, hw.shared_memory_per_block_kb) * 1024.0,
            registers_per_sm=hw.registers_per_sm or 65536,
            warp=hw.warp_size,
            l2_bytes=hw.l2_kb * 1024.0,
            dram_bytes_per_s=hw.memory_bandwidth_gbs * 1e9,
        )


class GpuAnalyzer:
    """Estimates GPU latency of candidate programs given as nests (see module docstring)."""

    def __init__(self, hardware: Hardware):
        self.machine = GpuMachine.from_hardware(hardware)

    def latency(self, nests: list[Nest]) -> np.ndarray:
        """[N] estimated seconds; inf where the kernel cannot launch."""
        m = self.machine
        n = nests[0].size
        kernel = _Kernel.of(nests, m)
        total = np.zeros(n)
        for nest in nests:
            total += np.where(nest.active, self._statement(nest, kernel), 0.0)
        kernels = sum(1 for nest in nests if nest.own_start == 0)  # attached statements share their anchor's
        total += KERNEL_LAUNCH_S * max(1, kernels)
        return np.where(kernel.valid, total, np.inf)

    def _statement(self, nest: Nest, kernel: _Kernel) -> np.ndarray:
        m = self.machine
        geo = geometry(nest)
        iterations = geo.count[:, -1]
        bound = (nest.thread != 0).any()
        blocks = _extent(nest, BLOCK_IDX) if bound else np.maximum(1.0, iterations / DEFAULT_THREADS)
        threads = _extent(nest, THREAD_IDX) if bound else np.minimum(iterations, DEFAULT_THREADS)
        threads = np.where(nest.coop_lanes > 0, nest.team, threads)
        sm_fill = blocks / (np.ceil(blocks / m.sm_count) * m.sm_count)  # wave quantization over the SMs
        warp_fill = threads / (np.ceil(threads / m.warp) * m.warp)
        ilp = _chains(nest) * _extent(nest, VTHREAD)
        warps_per_scheduler = kernel.warps_per_sm / SCHEDULERS_PER_SM
        hiding = np.minimum(1.0, warps_per_scheduler * np.minimum(ilp, 8.0) / FMA_LATENCY_CYCLES)
        compute = iterations * nest.ops * kernel.spill / (m.fma_per_s * sm_fill * warp_fill * hiding)

        access_bytes = nest.elem_bytes
        is_global = np.array([a.scope == "global" for a in nest.accesses])
        is_shared = np.array([a.scope.startswith("shared") for a in nest.accesses])
        per_thread = _inner_start(nest)
        capacity = np.full(nest.size, 4.0 * REUSE_REGISTERS)
        moved = traffic(geo, access_bytes, capacity, start=per_thread)  # [N, A] elements
        coalesced = _coalescing(nest)
        global_bytes = (moved * access_bytes / coalesced * is_global).sum(axis=1)
        unique = sum(float(np.prod(a.shape)) * a.elem_bytes for a, g in zip(nest.accesses, is_global) if g)
        dram_bytes = np.where(unique <= 0.5 * m.l2_bytes, np.minimum(global_bytes, unique), global_bytes)
        shared_bytes = (moved * access_bytes * is_shared).sum(axis=1)
        times = np.stack([
            compute,
            dram_bytes / m.dram_bytes_per_s,
            global_bytes / (m.dram_bytes_per_s * L2_OVER_DRAM_BANDWIDTH),
            shared_bytes / (SHARED_BYTES_PER_CYCLE * m.sm_count * m.clock_hz * sm_fill),
        ])
        return times.max(axis=0)


@dataclass
class _Kernel:
    """Per-candidate occupancy of the kernel the tiled statements form."""

    blocks_per_sm: np.ndarray
    warps_per_sm: np.ndarray
    valid: np.ndarray
    spill: np.ndarray  # >1: registers a thread wants over the limit, spilled to local memory

    @classmethod
    def of(cls, nests: list[Nest], m: GpuMachine) -> _Kernel:
        n = nests[0].size
        threads = np.ones(n)
        shared = np.zeros(n)
        registers = np.full(n, float(BASE_REGISTERS))
        valid = np.ones(n, dtype=bool)
        for nest in nests:
            if nest.coop_lanes.any():
                shared += _shared_footprint(nest) * nest.versions * nest.active
                continue
            if not (nest.thread == THREAD_IDX).any():
                continue
            block_threads = _extent(nest, THREAD_IDX)
            low, high = nest.thread_bounds
            valid &= (block_threads >= low) & (block_threads <= high)
            threads = np.maximum(threads, block_threads)
            registers = np.maximum(registers, BASE_REGISTERS + _thread_local_elements(nest))
        valid &= (threads <= m.max_threads_per_block) & (shared <= m.shared_bytes_per_block)
        spill = np.maximum(1.0, registers / MAX_REGISTERS_PER_THREAD)
        registers = np.minimum(registers, MAX_REGISTERS_PER_THREAD)
        by_threads = np.floor(MAX_THREADS_PER_SM / threads)
        by_shared = np.where(shared > 0, np.floor(m.shared_bytes_per_sm / np.maximum(shared, 1.0)), MAX_BLOCKS_PER_SM)
        by_registers = np.floor(m.registers_per_sm / (registers * threads))
        blocks = np.maximum(1.0, np.minimum.reduce([by_threads, by_shared, by_registers,
                                                    np.full(n, float(MAX_BLOCKS_PER_SM))]))
        warps = blocks * np.ceil(threads / m.warp)
        return cls(blocks, np.minimum(warps, MAX_THREADS_PER_SM / m.warp), valid, spill)


def _extent(nest: Nest, kind: int) -> np.ndarray:
    return np.prod(np.where(nest.thread[None, :] == kind, nest.ext, 1.0), axis=1)


def _inner_start(nest: Nest) -> np.ndarray:
    """[N] first loop executed by one thread alone (inside every thread-bound loop)."""
    bound = np.flatnonzero(nest.thread != 0)
    return np.full(nest.size, int(bound.max()) + 1 if len(bound) else 0)


def _chains(nest: Nest) -> np.ndarray:
    """[N] independent accumulators inside the innermost reduction loop (many without one)."""
    reduce = np.flatnonzero(nest.reduce)
    if not len(reduce):
        return np.full(nest.size, 8.0)
    inner = (np.arange(nest.ext.shape[1]) > reduce.max()) & (nest.thread == 0)
    return np.prod(np.where(inner[None, :], nest.ext, 1.0), axis=1)


def _thread_local_elements(nest: Nest) -> np.ndarray:
    """[N] registers a thread of a tiled statement holds: its accumulator tile plus operands."""
    if not nest.writes.any():
        return np.zeros(nest.size)
    held = ((nest.thread == 0) | (nest.thread == VTHREAD)) & ~nest.reduce
    return np.prod(np.where(held[None, :], nest.ext, 1.0), axis=1) + 8.0


def _shared_footprint(nest: Nest) -> np.ndarray:
    """[N] bytes of the shared buffer a cooperative copy fills per block: its own loops' region."""
    own = np.prod(nest.ext[:, nest.own_start:], axis=1)
    written = [a for a in nest.accesses if a.write]
    return own * (written[0].elem_bytes if written else 4.0)


def _coalescing(nest: Nest) -> np.ndarray:
    """[N, A] fraction of each fetched 32-byte sector a warp uses, from adjacent threads' stride."""
    threads = np.flatnonzero(nest.thread == THREAD_IDX)
    n, accesses = nest.size, len(nest.accesses)
    if nest.coop_lanes.any() or not len(threads):
        return np.ones((n, accesses))  # cooperative copies are laid out contiguous per thread
    dims = nest.dim_size
    row_stride = np.concatenate([np.cumprod(dims[:, ::-1], axis=1)[:, ::-1][:, 1:], np.ones((dims.shape[0], 1))], 1)
    stride = np.einsum("nad,ad->na", nest.coef[:, :, :, threads.max()], row_stride)
    per_sector = SECTOR_BYTES / nest.elem_bytes[None, :]
    return 1.0 / np.clip(stride, 1.0, per_sector)
