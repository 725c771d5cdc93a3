"""Side-by-side timing shared by the benchmarks: the compared systems take turns over rounds, so the
drifts of a shared machine hit all of them, and each round's median and the fastest call are kept."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def add_keep_option(parser: argparse.ArgumentParser) -> None:
    """`--keep DIR`: the builds go to a new directory that stays, so their artifacts can be timed again."""
    parser.add_argument("--keep", type=Path, help="build in this new directory and keep it (the artifacts can "
                        "then be timed again: a slow spell of the VM during the timing spoils every ratio)")


def build_directory(keep: Path | None, prefix: str) -> contextlib.AbstractContextManager[str]:
    """`keep`, created new (nothing of the user's is overwritten), or a temporary directory removed after."""
    if keep is None:
        return tempfile.TemporaryDirectory(prefix=prefix)
    keep.mkdir(parents=True)
    return contextlib.nullcontext(str(keep))


def c_compiler() -> str | None:
    """The C compiler the benchmarks build their native probes with: $CC, else cc, else gcc; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def sample_calls(fn: Callable[[], Any], min_s: float, min_calls: int) -> list[float]:
    """Back-to-back calls for at least `min_s` seconds and `min_calls` calls: each call's seconds."""
    samples = []
    deadline = time.perf_counter() + min_s
    while len(samples) < min_calls or time.perf_counter() < deadline:
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return samples


def interleaved_rounds(
    runners: dict[str, Callable[[], Any]],
    repeats: int,
    min_s: float,
    min_calls: int,
    on_round: Callable[[int, dict[str, list[float]]], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each system's median call per round and its fastest single call, in seconds.

    One warm-up call each first (allocation, first-call compilation, thread pools); the order of the
    systems is reversed every other round. `on_round(index, rounds so far)` after each round.
    """
    rounds: dict[str, list[float]] = {name: [] for name in runners}
    best = {name: float("inf") for name in runners}
    for fn in runners.values():
        fn()
    for index in range(repeats):
        for name in (list(runners) if index % 2 == 0 else list(reversed(runners))):
            samples = sample_calls(runners[name], min_s, min_calls)
            rounds[name].append(float(np.median(samples)))
            best[name] = min(best[name], min(samples))
        if on_round:
            on_round(index, rounds)
    return rounds, best


def kernel_calls(vm, args: list, runs: int, only: Callable[[tuple], bool] | None = None
                 ) -> list[tuple[str, tuple[int, ...] | None, float]]:
    """Every VM call of `runs` inferences (or those whose arguments `only` accepts), timed by the VM's instrument
    hook: (symbol, the shape of the call's last argument (a kernel's output) or None, seconds). One untimed call
    first: the first call's one-time costs showed as 0.41 ms of a 0.03 ms kernel. Only the shape is kept: holding
    the output tensor kept its storage from the VM's pool, so every run wrote its large outputs into fresh pages
    (MobileNet-V2's 96x112x112 stage showed 0.80 ms for a kernel that takes 0.10 ms)."""
    calls: list[tuple[str, tuple[int, ...] | None, float]] = []
    started: list[float] = []

    def instrument(func, symbol, before_run, ret_value, *call_args) -> int:
        if only is not None and not only(call_args):
            return 0
        if before_run:
            started.append(time.perf_counter())
        else:
            seconds = time.perf_counter() - started.pop()
            out = call_args[-1] if call_args else None
            shape = tuple(int(d) for d in out.shape) if hasattr(out, "shape") else None
            calls.append((str(symbol), shape, seconds))
        return 0  # VMInstrumentReturnKind.NO_OP

    vm["main"](*args)
    vm.set_instrument(instrument)
    for _ in range(runs):
        vm["main"](*args)
    vm.set_instrument(None)
    return calls


def paired_ratio(numerator_rounds: list[float], denominator_rounds: list[float]) -> float:
    """The median over rounds of numerator / denominator, each round's pair timed in turns: a spell of the machine
    that slows both within a round cancels out, where a ratio of the two medians can pair a slow round of one with
    a fast one of the other."""
    return float(np.median([n / d for n, d in zip(numerator_rounds, denominator_rounds, strict=True)]))


REFERENCE = "onnxruntime"
PLACEMENTS = "placements"
"""The key under which a timing process lists its rounds' placements of the CPUs (placement.py)."""


@dataclass
class ArtifactTimes:
    """Artifacts and ONNX Runtime timed in turns, in one or more processes (one per way the artifacts' threads
    wait), each process timing ONNX Runtime among its artifacts. The processes run one after another, so their
    rounds are compared only through the ONNX Runtime timed in each: in one such run, ONNX Runtime's median was
    36.83 ms in the first process and 22.75 ms in the second, minutes later, and a ratio to one median of both
    (29.79 ms) put an artifact at 1.37x where its own rounds, paired with ONNX Runtime's, said 1.10x."""

    processes: list[dict[str, list]]  # per timing process: each system's median ms per round, and PLACEMENTS

    def _rounds_of(self, name: str) -> dict[str, list[float]]:
        return next(rounds for rounds in self.processes if name in rounds)

    def ms(self, name: str) -> float:
        return float(np.median(self._rounds_of(name)[name]))

    def reference_ms(self, name: str | None = None) -> float:
        """ONNX Runtime's median beside `name`; None: the median of the processes' medians."""
        if name is not None:
            return float(np.median(self._rounds_of(name)[REFERENCE]))
        return float(np.median([np.median(rounds[REFERENCE]) for rounds in self.processes]))

    def vs_reference(self, name: str) -> float:
        """How many times faster than ONNX Runtime `name` ran, round by round beside it (paired_ratio)."""
        rounds = self._rounds_of(name)
        return paired_ratio(rounds[REFERENCE], rounds[name])

    def vs_reference_by_placement(self, name: str) -> dict[str, tuple[int, float]]:
        """`vs_reference` over the rounds of each placement of the CPUs (placement.py): their count and the ratio;
        empty where the timing process did not label its rounds."""
        rounds = self._rounds_of(name)
        labels = rounds.get(PLACEMENTS, [])
        by_label: dict[str, tuple[int, float]] = {}
        for label in sorted(set(labels)):
            mine = [i for i, each in enumerate(labels) if each == label]
            by_label[label] = (len(mine), paired_ratio([rounds[REFERENCE][i] for i in mine],
                                                       [rounds[name][i] for i in mine]))
        return by_label

    def relative(self, name: str, base: str) -> float:
        """`name`'s time against `base`'s: round by round where one process timed both, else through the ONNX
        Runtime each was timed beside."""
        rounds = self._rounds_of(name)
        if base in rounds:
            return paired_ratio(rounds[name], rounds[base])
        return self.vs_reference(base) / self.vs_reference(name)
