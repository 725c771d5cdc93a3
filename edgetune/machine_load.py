"""How many of this machine's cores other programs keep busy, so that kernels are timed on the cores left.

A kernel timed on two threads beside one busy loop at normal priority (2-core VM) waits at every parallel
loop's end for the thread that shares its core with the loop: 20 ResNet-50 candidates of each of four tasks
ran 3-11x slow and ranked at random (Spearman rho -0.17 to 0.36 against the same candidates timed idle).
Timed on one thread, on the core the loop left, they ran 1.8x slow and ranked as a second idle timing does
(rho 0.81-0.96; idle against idle 0.68-0.94), and the tuner's pick lost at most 7%.

Linux only (/proc); elsewhere no core counts as taken.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")

TAKEN_CORE = 0.5
"""Other programs that used at least this share of a core between two readings hold it: a busy loop beside a
build that keeps both cores busy gets 0.6-1.0 of one; an idle machine's daemons use 0.01-0.05."""


@dataclass
class _Process:
    parent: int
    ticks: int  # CPU time of the process and of its children it waited for, in clock ticks
    nice: int


class OtherLoad:
    """Cores that processes other than this one and its descendants (the build's workers) used between readings.

    Only processes at this one's priority or above count: the scheduler gives a lower-priority one little of a
    core that this process's threads want.
    """

    def __init__(self) -> None:
        self._counted = self._others(_processes())  # the other processes' ticks at the last reading
        self._last_at = time.monotonic()

    def cores_taken(self) -> float:
        """Cores' worth of CPU time the other programs used since the last reading (or since this object began).

        A process that ended since then is taken off: its parent, which waited for it, counts its whole time."""
        now, now_at = self._others(_processes()), time.monotonic()
        seconds = now_at - self._last_at
        ticks = sum(total - self._counted.get(pid, 0) for pid, total in now.items())
        ticks -= sum(total for pid, total in self._counted.items() if pid not in now)
        self._counted, self._last_at = now, now_at
        return max(ticks, 0) / os.sysconf("SC_CLK_TCK") / seconds if seconds > 0 else 0.0

    @staticmethod
    def _others(processes: dict[int, _Process]) -> dict[int, int]:
        """The ticks of every process that counts: not this one or below it, and not of a lower priority."""
        own_nice = os.nice(0)
        ours = _descendants(processes, os.getpid())
        return {pid: p.ticks for pid, p in processes.items() if pid not in ours and p.nice <= own_nice}

    def free_threads(self, wanted: int) -> int:
        """How many of `wanted` threads fit on the cores the other programs left since the last reading (>= 1)."""
        taken = math.floor(self.cores_taken() + 1 - TAKEN_CORE)
        return max(1, min(wanted, (os.cpu_count() or 1) - taken))


def sampled_free_threads(wanted: int, seconds: float = 0.3) -> int:
    """`free_threads` over a short wait of this process: a caller about to time something, with no reading before."""
    load = OtherLoad()
    time.sleep(seconds)
    return load.free_threads(wanted)


@contextmanager
def on_free_cores(cores: int | None) -> Iterator[int | None]:
    """TVM's pool in this process narrowed, for the block, to as many of `cores` threads as other programs leave
    cores free, then widened again; yields the threads it runs on (None where `cores` is None: no thread count
    is set). For a model timed whole in this process, as the tuner times candidates (module docstring)."""
    if not cores:
        yield None
        return
    from edgetune.runtime import use_cpu_threads

    threads = sampled_free_threads(cores)
    use_cpu_threads(cores, running=threads)  # the threads the model ships with, narrowed
    try:
        yield threads
    finally:
        use_cpu_threads(cores)


def waited_for_a_core_s() -> float:
    """Seconds the calling thread has spent ready to run while no core was free for it (the kernel's run-queue wait,
    /proc/thread-self/schedstat); 0 where the kernel does not say. A span's wall time less what this grew by is
    about what the span takes where nothing else wants the cores."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _processes() -> dict[int, _Process]:
    """Every process's parent, CPU ticks and nice value; empty where there is no /proc."""
    found: dict[int, _Process] = {}
    try:
        entries = [entry for entry in _PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return found
    for entry in entries:
        fields = stat_fields(int(entry.name))
        if fields is None or len(fields) < 17:  # it ended meanwhile, or its line is not whole
            continue
        user, system, children_user, children_system = (int(value) for value in fields[11:15])
        found[int(entry.name)] = _Process(int(fields[1]), user + system + children_user + children_system,
                                          int(fields[16]))
    return found


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (the first: field 3, the state); None where no such
    process runs or there is no /proc. The name, in parentheses, may hold anything: spaces, parentheses."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _descendants(processes: dict[int, _Process], root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, process in processes.items():
        children.setdefault(process.parent, []).append(pid)
    found, pending = {root}, [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


@contextmanager
def low_priority_busy_process() -> Iterator[None]:
    """A busy loop at nice 19 for the duration of the block, ended with it: the other work an artifact most often
    meets on a shared machine (a batch job at low priority), beside which the build times the ways the artifact's
    threads can wait (build/measure.py). It is this process's child, so the tuning's load readings never see it."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        os.setpriority(os.PRIO_PROCESS, loop.pid, 19)  # here, not by the loop: its interpreter may start late
        time.sleep(BUSY_START_S)  # its interpreter started and looping
        yield
    finally:
        loop.kill()
        loop.wait()


BUSY_START_S = 0.2
"""What a Python busy loop takes to start looping (its interpreter's start)."""
