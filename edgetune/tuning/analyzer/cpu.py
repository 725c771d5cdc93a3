"""CPU draft model: a loop nest's latency from the device profile's cores, SIMD and caches.

Per statement, for N candidates at once:

- compute: instructions = iterations x ops / elements per vector instruction (the vectorized
  loop's extent packed into SIMD lanes), issued on the FP pipes; slowed when the innermost
  reduction loop leaves too few independent accumulators to cover the FMA latency (short
  reduction runs let the out-of-order window overlap the next tile), when the accumulator tile
  outgrows the register file (spills), and when unrolled code outgrows the decoded-instruction
  cache; plus loop overhead for loops neither unrolled nor vectorized; divided over the cores
  the parallel loop keeps busy (load balance included);
- memory: for registers (only what fully unrolled/vectorized code touches), L1, L2, L3 and
  DRAM, the data moved into that level given its capacity and the tiles' footprints and reuse
  (`nest.traffic`), over that level's bandwidth;
- latency = max(compute, slowest level) + parallel launch overhead; summed over statements.

The numbers are the profile's (cores, clock, vector_bits, vector_pipes or flops_per_cycle, cache sizes,
memory_bandwidth_gbs) plus per-level bandwidths and core constants typical of current cores
(below). The spill, out-of-order and code-size constants were checked against ~640 measured
random and analyzer-picked schedules of a 3x3 conv2d (C6) and a 512^3 matmul on this machine's
Zen 3 (Spearman 0.62 and 0.75 between estimate and measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgetune.profiles import Hardware
from edgetune.tuning.analyzer.nest import Nest, geometry, grouped_extent, traffic

FMA_LATENCY_CYCLES = 4.0
"""Latency of a vector FMA: a reduction chain issues one every this many cycles."""
OOO_WINDOW_FMAS = 32.0
"""Multiply-adds of later iterations the out-of-order window overlaps with a short reduction run."""
OPERAND_REGISTERS = 4
"""Vector registers a micro-kernel needs besides its accumulators (broadcasts, loaded operands)."""
SPILL_WEIGHT = 2.0
"""Slowdown per register file's worth of accumulators beyond what fits (spill loads and stores)."""
CODE_LIMIT_INSTRUCTIONS = 2048.0
"""Straight-line (unrolled) body size the decoded-instruction cache serves at full rate."""
CODE_WEIGHT = 0.5
"""Slowdown per CODE_LIMIT_INSTRUCTIONS of unrolled body beyond it (legacy decode, i-cache misses)."""
LOOP_OVERHEAD_CYCLES = 0.5
"""Issue slots a loop iteration costs (increment, compare, branch) on a 4-6 wide core."""
PARALLEL_LAUNCH_S = 5e-6
"""Fork-join of TVM's thread pool for one parallel loop."""
CACHE_SHARE = 0.5
"""Fraction of a cache the reuse model counts on (associativity, other data, prefetch)."""
LOADS_PER_CYCLE = 2.0
"""Vector loads a core issues per cycle (L1 -> registers)."""
STORES_PER_CYCLE = 1.0
REGISTER_SHARE = 0.75
"""Fraction of the vector register file a tile may use (the rest holds operands and addresses)."""
FILL_BYTES_PER_CYCLE = (64.0, 32.0, 16.0)
"""Bytes per cycle per core into L1 (from L2), into L2 (from L3), into L3 (from DRAM, capped below)."""


@dataclass(frozen=True)
class CpuMachine:
    """What the CPU model needs, derived from a device profile's hardware section."""

    cores: int
    clock_hz: float
    lanes: float  # fp32 lanes per vector register
    pipes: float  # vector FP instructions issued per cycle
    registers: int
    caches_bytes: tuple[float, ...]  # L1, L2, L3 (per core for L1/L2; L3 shared)
    dram_bytes_per_s: float

    @classmethod
    def from_hardware(cls, hw: Hardware, isa: str = "x86_64") -> CpuMachine:
        vector_bits = hw.vector_bits or 128
        lanes = vector_bits / 32
        pipes = float(hw.vector_pipes) if hw.vector_pipes else max(1.0, hw.flops_per_cycle / (2 * lanes))
        registers = 32 if isa in ("aarch64",) or vector_bits >= 512 else 16
        caches = tuple(kb * 1024.0 for kb in (hw.l1d_kb, hw.l2_kb, hw.l3_kb) if kb > 0)
        return cls(
            cores=hw.cores or 1,
            clock_hz=hw.clock_ghz * 1e9,
            lanes=lanes,
            pipes=pipes,
            registers=registers,
            caches_bytes=caches,
            dram_bytes_per_s=hw.memory_bandwidth_gbs * 1e9,
        )


class CpuAnalyzer:
    """Estimates CPU latency of candidate programs given as nests (see module docstring)."""

    def __init__(self, hardware: Hardware, isa: str = "x86_64"):
        self.machine = CpuMachine.from_hardware(hardware, isa)

    def latency(self, nests: list[Nest]) -> np.ndarray:
        """[N] estimated seconds: the sum over statements."""
        total = np.zeros(nests[0].size)
        for nest in nests:
            total += np.where(nest.active, self.statement_latency(nest), 0.0)
        return total

    def statement_latency(self, nest: Nest) -> np.ndarray:
        """[N] seconds of one statement: the slowest of compute and each memory level, plus launches."""
        times = self.statement_times(nest)
        launches = times.pop("launch")
        return np.max(np.stack(list(times.values())), axis=0) + launches

    def statement_times(self, nest: Nest) -> dict[str, np.ndarray]:
        """Each bound on a statement's time, in seconds: compute, registers, L1..., and launch."""
        m = self.machine
        n = nest.size
        geo = geometry(nest)
        iterations = geo.count[:, -1]

        parallel = grouped_extent(nest, nest.parallel)
        speedup = parallel / np.ceil(parallel / m.cores)
        busy = np.minimum(parallel, m.cores)

        width = grouped_extent(nest, nest.vector)
        lanes = m.lanes * 4.0 / float(nest.elem_bytes[nest.writes].max() if nest.writes.any() else 4.0)
        per_instruction = np.where(width > 1, width / np.ceil(width / lanes), 1.0)

        unrolled = _unrolled(nest)
        accumulators = _accumulators(nest, per_instruction)
        chains = np.maximum(accumulators, OOO_WINDOW_FMAS / _reduction_run(nest))
        ilp = np.minimum(1.0, chains / (FMA_LATENCY_CYCLES * m.pipes))
        usable = m.registers - OPERAND_REGISTERS
        spill = 1.0 + SPILL_WEIGHT * np.maximum(0.0, np.where(np.isfinite(accumulators), accumulators, 0) - usable) / usable
        vectors = np.where(width > 1, np.ceil(width / lanes), 1.0)
        steps = np.prod(np.where(unrolled & ~nest.vector, nest.ext, 1.0), axis=1)
        body = steps * (nest.ops + len(nest.accesses)) * vectors
        frontend = 1.0 + CODE_WEIGHT * np.maximum(0.0, body - CODE_LIMIT_INSTRUCTIONS) / CODE_LIMIT_INSTRUCTIONS
        instructions = iterations * nest.ops / per_instruction
        plain = ~(unrolled | nest.vector)
        overhead = np.sum(np.where(plain, geo.count[:, 1:], 0.0), axis=1) * LOOP_OVERHEAD_CYCLES
        compute_s = (instructions * spill * frontend / (m.pipes * ilp) + overhead) / speedup / m.clock_hz

        times = {"compute": compute_s, "registers": self._register_time(nest, geo, unrolled, per_instruction, speedup)}
        access_bytes = nest.elem_bytes
        for level, capacity in enumerate(m.caches_bytes):
            share = capacity / busy if level == 2 else np.full(n, capacity)
            moved = traffic(geo, access_bytes, share * CACHE_SHARE) @ access_bytes
            if level + 1 < len(m.caches_bytes):
                rate = FILL_BYTES_PER_CYCLE[min(level, 2)] * m.clock_hz * speedup
            else:
                rate = np.minimum(FILL_BYTES_PER_CYCLE[min(level, 2)] * m.clock_hz * speedup, m.dram_bytes_per_s)
            times[f"L{level + 1}"] = moved / rate
        launches = np.where(nest.parallel.any(axis=1),
                            geo.count[np.arange(n), np.argmax(nest.parallel, axis=1)], 0.0)
        times["launch"] = launches * PARALLEL_LAUNCH_S
        return times

    def _register_time(self, nest: Nest, geo, unrolled: np.ndarray, per_instruction: np.ndarray,
                       speedup: np.ndarray) -> np.ndarray:
        """Seconds of L1 <-> register traffic: registers only hold what straight-line code reuses.

        Loops that are fully unrolled or vectorized (and loops around them, whose iterations
        reuse the same registers) can keep data in registers; a tile wider than the register
        file spills. Writes cost a load and a store (stores issue at half the load rate).
        """
        m = self.machine
        n, loops = nest.ext.shape
        straight = unrolled | nest.vector | (nest.ext == 1)
        tail = np.cumprod(straight[:, ::-1], axis=1)[:, ::-1].astype(bool)  # loops l.. all straight-line
        start = np.where(tail.any(axis=1), np.argmax(tail, axis=1), loops)
        vector_bytes = m.lanes * 4.0
        capacity = np.full(n, REGISTER_SHARE * m.registers * vector_bytes)
        moved = traffic(geo, nest.elem_bytes, capacity, start=start)  # [N, A] elements
        along_vector = (nest.coef * nest.vector[:, None, None, :]).sum(axis=(2, 3)) > 0  # [N, A]
        instructions = np.where(along_vector, moved / per_instruction[:, None], moved)
        cycles = instructions.sum(axis=1) / LOADS_PER_CYCLE
        cycles += (instructions * nest.writes[None, :]).sum(axis=1) / STORES_PER_CYCLE
        return cycles / (m.clock_hz * speedup)


def _accumulators(nest: Nest, per_instruction: np.ndarray) -> np.ndarray:
    """[N] independent accumulators (vector registers) inside the innermost reduction loop.

    inf when the statement does not reduce: nothing then chains one instruction to the next.
    """
    reduce = np.flatnonzero(nest.reduce)
    if not len(reduce):
        return np.full(nest.size, np.inf)
    inner = np.arange(nest.ext.shape[1]) > reduce.max()
    elements = np.prod(np.where(inner[None, :], nest.ext, 1.0), axis=1)
    vectorized_inside = (nest.vector & inner[None, :]).any(axis=1)
    return np.where(vectorized_inside, elements / per_instruction, elements)


def _reduction_run(nest: Nest) -> np.ndarray:
    """[N] length of the accumulation chain: the reduction loops around the accumulator tile."""
    run = np.ones(nest.size)
    reduce = np.flatnonzero(nest.reduce)
    if not len(reduce):
        return run
    going = np.ones(nest.size, dtype=bool)
    for l in range(int(reduce.max()), -1, -1):
        if nest.reduce[l]:
            run = np.where(going, run * nest.ext[:, l], run)
        else:
            going &= nest.ext[:, l] == 1
    return run


def _unrolled(nest: Nest) -> np.ndarray:
    """[N, L] loops the auto-unroll pragma unrolls: innermost loops within max steps in total."""
    n, loops = nest.ext.shape
    result = np.zeros((n, loops), dtype=bool)
    steps = np.ones(n)
    going = nest.unroll > 0
    for l in range(loops - 1, -1, -1):
        steps = np.where(nest.vector[:, l], steps, steps * nest.ext[:, l])
        going &= steps <= nest.unroll
        result[:, l] = going
    return result
