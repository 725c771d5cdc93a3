"""The untuned model, compiled and exported in a process of its own beside a compile of this one (a large one).

A compile leaves a core idle for part of its time (its relax passes run on one): on a 2-core machine MobileNet-V2's
tuned compile took 14.5-15.1 s with the untuned one compiling beside it in another process against 10.4-11.0 s alone,
and both libraries were ready after 17.0-19.7 s against 26.3-27.0 s one after the other (the reserve counts its
compile without that contention: selection.rank_cost). The untuned model is compiled
once per target, for the manifest's untuned latency and as the default schedules of the in-model comparison.
It starts beside the budget's reserve compile (build/tune.py) or else the first compile after tuning
(build/compile.py), and whatever times anything here waits for it first: a compile beside a timing disturbs it.
TVM's compile is not thread-safe (TOPI keeps a global tag), hence a process, not a thread. The process holds
a compile's memory of its own (an untuned ResNet-50, 102 MB of weights: 1.38 GB), so it runs only where the
machine has that free beside this process's compile; elsewhere it is compiled here, when first asked for.
A small model is compiled here too: the process's start costs more than its compile (`compile_apart_pays`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

COMPILE_BYTES_PER_WEIGHT_BYTE = 4
COMPILE_BASE_BYTES = 1 << 30
"""A compile's memory at its peak, at most this base plus this many times the model's weights (an untuned
ResNet-50 compiled apart: 1.38 GB for 102 MB of weights, within 1.43 GB). Compiling apart needs twice that
free: its own compile, and the one of this process beside it."""

APART_MIN_CALLS = 48
APART_MIN_WEIGHT_BYTES = 16 << 20
"""A compile apart starts a process that imports TVM: 1.9 s of CPU more than compiling here (tiny_cnn's untuned
model: 2.9 s apart, 0.7-1.1 s here). It pays for a model whose compile takes longer than that start: ResNet-18
(70 operator calls, 47 MB of weights) 10 s, MobileNet-V2 (188 calls, 14 MB) 19-21 s. The tests' corpus of exported
models (4-33 calls, under 0.1 MB) compiled in 0.5-1.6 s each, where a process apart would have doubled the CPU
it takes. Compile time grows with the calls (a kernel each) and with the weights (packed and written out)."""


class UntunedModel:
    """The target's untuned model library, compiled once (apart, or here when `apart` is False or memory is short);
    `library()` waits for it."""

    def __init__(self, relax_mod: Any, target: Any, winograd: Any, path: Path,
                 link_compiler: Callable[[], str | None], weight_bytes: int,
                 say: Callable[[str], None] = lambda message: None, apart: bool = True) -> None:
        self._apart = apart  # False: compiled here, when first asked for (see compile_apart_pays)
        self._relax_mod, self._target, self._winograd, self._path = relax_mod, target, winograd, path
        self._link_compiler = link_compiler  # asked when the compile starts: a device that cannot link refuses
        self._needed_bytes = 2 * (COMPILE_BASE_BYTES + COMPILE_BYTES_PER_WEIGHT_BYTE * weight_bytes)
        self._say, self._said = say, False
        self._process: Any = None  # multiprocessing's SpawnProcess
        self._receiver: Connection | None = None
        self._library: Path | None = None
        self._latency_ms: float | None = None

    def start(self) -> None:
        """Begin the compile in a fresh process, unless it began already, or the machine lacks the memory for it
        (then `library()` compiles it here), or it is not worth a process of its own."""
        if not self._apart or self._process is not None or self._library is not None or not self._memory_allows():
            return
        spawn = get_context("spawn")
        receiver, sender = spawn.Pipe(duplex=False)
        arguments = pickle.dumps(self._arguments())  # read there after PyTorch is kept out (TVM imports it)
        self._process = spawn.Process(target=_compile_apart, args=(sender, arguments), daemon=True)
        self._process.start()
        sender.close()  # the child holds the only sending end: its exit without a word reads as EOF here
        self._receiver = receiver

    def library(self) -> Path:
        """The exported library, once compiled (started now if it had not been). Where the process failed or was
        lost, the compile runs again in this process, so that a real error is raised here, as TVM's own."""
        from edgetune.compile import export_untuned

        self.start()
        if self._library is None and self._receiver is not None:
            try:
                self._library = Path(self._receiver.recv())
            except EOFError:  # it ended without a library
                pass
            finally:
                self.close()
        if self._library is None:
            self._library = export_untuned(*self._arguments())
        return self._library

    @property
    def compiling_apart(self) -> bool:
        """Whether its compile runs in a process of its own now, beside whatever this process does."""
        return self._process is not None and self._library is None

    def latency_ms(self, time_library: Callable[[Path], float]) -> float:
        """Its latency, timed by `time_library` once per build: where a budget sizes its reserve, then (the
        library is ready, and the stages after tuning keep no guess of its time), else by the measure stage."""
        if self._latency_ms is None:
            self._latency_ms = time_library(self.library())
        return self._latency_ms

    def close(self) -> None:
        """End the process: a build that failed or was stopped does not wait for its compile."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.terminate()
            self._process.join()
            self._process = None

    def _memory_allows(self) -> bool:
        free = free_memory_bytes()
        if free >= self._needed_bytes:
            return True
        if not self._said:
            self._said = True
            self._say(f"the untuned model is compiled on its own, not beside another compile: {free / 1e9:.1f} GB "
                      f"of memory free, two compiles at once would need {self._needed_bytes / 1e9:.1f} GB")
        return False

    def _arguments(self) -> tuple:
        return self._relax_mod, self._target, self._winograd, self._path, self._link_compiler()


def compile_apart_pays(relax_mod: Any, weight_bytes: int) -> bool:
    """Whether the model's compile takes longer than starting a process for it (APART_MIN_CALLS)."""
    if weight_bytes >= APART_MIN_WEIGHT_BYTES:
        return True
    from edgetune.compile import operator_calls

    return operator_calls(relax_mod) >= APART_MIN_CALLS


def free_memory_bytes() -> int:
    """Memory the machine can give without swapping (the kernel's MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


def _compile_apart(sender: Connection, arguments: bytes) -> None:
    """The process's work: compile and export, then send the library's path; on failure send nothing (the
    parent compiles again and raises the error itself)."""
    from edgetune.isolated import keep_torch_out

    keep_torch_out()
    from edgetune.compile import export_untuned

    try:
        path = export_untuned(*pickle.loads(arguments))
    except Exception:  # noqa: BLE001  # any failure: the parent's own compile raises it, with TVM's message
        return
    sender.send(str(path))
