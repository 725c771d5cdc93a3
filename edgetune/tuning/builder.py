"""Candidate builder: MetaSchedule's local build, on long-lived workers, without the 10-second import.

TVM's LocalBuilder starts new workers for every batch; these workers (tuning/worker_pool.py) last the
whole tuning run. TVM's default build function imports `tvm.s_tir.tensor_intrin` (mostly CUDA
intrinsics) in every fresh worker; for the targets edgetune tunes on the CPU that import buys nothing,
so this build function does the same lowering without it. A batch waits for its slowest build, so a
candidate that builds far longer than the rest of its batch is cut short (`cut_stragglers`).
Candidates are linked into shared objects here, in the builder's workers (`shared_object_export`): TVM's
default `.tar` export leaves the link to whoever loads it, and the runner times one candidate at a time.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import TYPE_CHECKING

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func

from edgetune.machine_load import stat_fields
from edgetune.tuning.analyzer.tir import parallel_extent
from edgetune.tuning.worker_pool import Job, WorkerPool

if TYPE_CHECKING:
    import tvm

STRAGGLER_FACTOR, STRAGGLER_FLOOR_S = 10.0, 5.0
"""Once half a batch is built, a candidate still building after this many times the median build of the
batch's finished ones (and at least the floor) is killed and recorded as a failed build. The batch waits
for its slowest build while the other workers sit idle: a ResNet-18 classifier candidate (vectors of 40
lanes under an unroll of 512) spent 25 s in LLVM where its batch's others took 0.1 s, and then ran at
twice the task's best. In that build's 813 candidates (rebuilt one by one) a build took 0.32 s at the median,
2.6 s at the 99th percentile and 3.4 s at most, but for that one (27 s)."""
PARALLEL_EXTENT_FILE = "parallel_extent"
"""Beside each built candidate: the iterations of the parallel loop around its largest block (analyzer's
`parallel_extent`; 1: it runs on one core). The runner scales a timing taken on fewer threads by it."""
STRAGGLER_ERROR = "LocalBuilder: a straggler"
"""How a cut build's error message starts (counted per task: TaskOutcome.builds_cut)."""


def export_shared_object(compiler: str | None, parent: str, module) -> str:
    """Link a built candidate into a shared object in a directory of its own under `parent` (runs in a builder
    worker): with the device's (cross) compiler, or with None for this machine (`link_for_this_machine`)."""
    from tvm.support import cc

    directory = tempfile.mkdtemp(prefix="candidate-", dir=parent)
    path = os.path.join(directory, "candidate.so")
    try:
        if compiler is None:
            module.export_library(path, fcompile=link_for_this_machine)
        else:
            module.export_library(path, fcompile=cc.cross_compiler(compiler))
    except BaseException:  # a failed link leaves no directory behind (the runner removes the linked ones)
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return path


def link_for_this_machine(output: str, objects: list[str], options: list[str] | None = None) -> None:
    """TVM's `create_shared` for a candidate's objects, with the linker called directly where there is one (Linux,
    `ld` on the PATH): `g++ -shared` starts its driver and collect2 before `ld`, 35 ms of a candidate's link against
    5 ms (medians of 40 MobileNet-V2 candidates, a 2-core Zen 1 VM), where building the candidate took 370 ms.
    What the driver adds is not needed: a kernel's outside symbols (TVM's error call, `memset`, libm's `expf`) are
    found where the runner loads it, in its worker's process (Python's own libraries), as TVM's are with `g++`.
    Anything but object files (a C source of packed imports) or extra options go to TVM's `create_shared`."""
    from tvm.support import cc

    linker = shutil.which("ld") if sys.platform.startswith("linux") else None
    if linker is None or options or not all(str(name).endswith(".o") for name in objects):
        cc.create_shared(output, objects, options)
        return
    linked = subprocess.run([linker, "-shared", "-o", output, *map(str, objects)], capture_output=True, text=True,
                            check=False)
    if linked.returncode != 0:
        raise RuntimeError(f"Linking failed:\n{linked.stdout}{linked.stderr}\nCommand line: {linker} -shared -o "
                           f"{output} {' '.join(map(str, objects))}")


def shared_object_export(compiler: str | None, parent: str) -> Callable:
    """The builder's `f_export` (see `export_shared_object`): picklable, so it reaches the builder's workers.

    Linked in the builder, a candidate is built in parallel with its batch's others and the runner only loads
    it. With TVM's `.tar` export the runner linked each candidate as it loaded it, while the other cores waited:
    39 ms per ResNet-18 convolution candidate against its 0.32 s build (means of 20), each time."""
    return functools.partial(export_shared_object, compiler, parent)


def linking_builder(max_workers: int, compiler: str | None, pool: WorkerPool | None = None) -> CandidateBuilder:
    """A builder that links each candidate (`shared_object_export`) under a directory that ends with the builder.

    MetaSchedule removes a candidate's directory once it is measured; one that never is (the device lost, a
    stop request, a worker killed after the link) left its directory in the temporary folder: 28 after a day of
    tests and benchmarks here, 5 after three 10-minute ResNet-18 builds. A build killed outright cannot remove its
    own: the next builder removes every such directory whose owner process has ended (`remove_orphaned_candidates`)."""
    remove_orphaned_candidates()
    parent = tempfile.mkdtemp(prefix=CANDIDATES_PREFIX)
    Path(parent, CANDIDATES_OWNER).write_text(f"{_process_identity(os.getpid())} {_pid_namespace()}")
    return CandidateBuilder(max_workers, f_export=shared_object_export(compiler, parent), pool=pool,
                            owned_dir=parent)


CANDIDATES_PREFIX = "edgetune-candidates-"
CANDIDATES_OWNER = "edgetune-owner"
"""A builder's directory holds this file: the process that made it (its pid, start time and pid namespace). Only
a directory holding one is ever removed by another process: a directory named like ours without it is not
edgetune's, or one whose owner is still writing it."""


def remove_orphaned_candidates() -> None:
    """Remove the builders' directories in the temporary folder whose owner process has ended (killed: a builder
    that closes removes its own). Linux only (/proc): elsewhere nothing is removed."""
    if not Path("/proc/self").is_dir():  # no process would read as running
        return
    this_namespace = _pid_namespace()
    for directory in Path(tempfile.gettempdir()).glob(CANDIDATES_PREFIX + "*"):
        try:
            owner = (directory / CANDIDATES_OWNER).read_text()
        except OSError:  # not ours, or its owner has not marked it yet
            continue
        pid, started, namespace = (owner.split(" ") + ["", "", ""])[:3]
        if namespace != this_namespace or not pid.isdigit():  # a container sharing this folder sees other pids
            continue
        if _process_identity(int(pid)) != f"{pid} {started}":
            shutil.rmtree(directory, ignore_errors=True)  # refuses a symlink: only our own directory goes


def _process_identity(pid: int) -> str | None:
    """"pid start-time" of a running process, a pid never named twice (Linux reuses pids); None if none runs or
    there is no /proc."""
    fields = stat_fields(pid)
    return None if fields is None else f"{pid} {fields[19]}"  # field 22: the process's start time


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[inode]"; "" where unreadable): pids name processes only inside one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params: object) -> tvm.runtime.Module:
    """MetaSchedule's default build, minus the tensor-intrinsic import (runs in a builder worker)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def build_and_export(f_export: Callable | None, mod: tvm.IRModule, target: tvm.target.Target,
                     params: bytearray | None) -> str:
    """A builder worker's job: MetaSchedule's build (`build_candidate`) and export of a candidate, and its parallel
    extent written beside it (PARALLEL_EXTENT_FILE). Returns the artifact's path."""
    artifact = _worker_func(build_candidate, f_export, mod, target, params)
    Path(artifact).with_name(PARALLEL_EXTENT_FILE).write_text(str(parallel_extent(mod)))
    return artifact


def parallel_extent_beside(artifact_path: str) -> int | None:
    """The parallel extent the builder wrote beside a candidate; None where there is none (built elsewhere)."""
    try:
        extent = int(Path(artifact_path).with_name(PARALLEL_EXTENT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return extent if extent >= 1 else None


@derived_object
class CandidateBuilder(PyBuilder):
    """Builds a batch of candidates in parallel, each into an artifact the runner loads.

    `f_export` None keeps TVM's `.tar` export (linked where it is loaded); the tuning links (`linking_builder`).
    `pool`: workers shared with the runner (default: `max_workers` of its own). `close()` ends the workers
    (they also end with the builder) and removes `owned_dir`, where the candidates were linked.
    """

    def __init__(self, max_workers: int, timeout_sec: float = 60.0, f_export: Callable | None = None,
                 pool: WorkerPool | None = None, owned_dir: str | None = None) -> None:
        super().__init__()
        self.timeout_sec = timeout_sec
        self.f_export = f_export
        self.pool = pool or WorkerPool(max_workers, timeout_sec)
        self.owned_dir = owned_dir

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        jobs = [self.pool.submit_job(self.timeout_sec, build_and_export, self.f_export, i.mod, i.target,
                                     _serialize_params(i.params)) for i in build_inputs]
        cut_stragglers(jobs)
        return [self._result(job) for job in jobs]

    def _result(self, job: Job) -> BuilderResult:
        try:
            return BuilderResult(job.future.result(), None)
        except TimeoutError:
            return BuilderResult(None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds")
        except Exception as exc:  # noqa: BLE001  # the candidate's own failure, reported as TVM's builder reports it
            if job.cut_short:
                return BuilderResult(None, f"{STRAGGLER_ERROR}, killed after {job.seconds():.1f} s: more "
                                           f"than {STRAGGLER_FACTOR:g} times its batch's median build")
            return BuilderResult(None, f"LocalBuilder: An exception occurred\n{exc}")

    def close(self) -> None:
        self.pool.shutdown()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)


def cut_stragglers(jobs: list[Job], factor: float = STRAGGLER_FACTOR, floor_s: float = STRAGGLER_FLOOR_S) -> int:
    """Waits for the jobs, killing each that runs past `factor` x the median of the finished ones (at least
    `floor_s`) once half of them have finished; returns how many were cut."""
    pending = {job.future: job for job in jobs}
    finished: list[float] = []
    cut = 0
    while pending:
        done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
        ended = [pending.pop(future) for future in done]
        finished += [job.seconds() for job in ended if not job.cut_short]
        if not finished or 2 * len(finished) < len(jobs):
            continue
        limit = max(floor_s, factor * statistics.median(finished))
        cut += sum(job.cut() for job in pending.values() if not job.cut_short and job.seconds() > limit)
    return cut
