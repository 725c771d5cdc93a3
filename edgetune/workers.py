"""Where a release's units of work run: a pool of local processes, or Ray (a local one, or a cluster).

A unit is one `pipeline.build(recipe, only=[target])`. Units share nothing in memory: a worker reads the
recipe's model and sibling stores and writes its artifact and its own record store on storage every worker
reaches (the recipe's output and records directories). Records are committed per measured batch and only
appended, so a unit whose worker dies is simply run again: it resumes from the records already committed.
A unit may split its tuning into shards of tasks (`edgetune.tuning.shards`) run on the same kind of workers:
nested Ray tasks (a unit waiting on them gives its CPU back to Ray), or a process pool of its own.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgetune.errors import BuildError, EdgetuneError, InputError
from edgetune.recipe import Recipe

if TYPE_CHECKING:
    from edgetune.pipeline import Event
    from edgetune.tuning.shards import ShardJob, ShardOutcome, ShardPool

RETRIES = 2
"""Times a unit whose worker was lost (killed, out of memory, node gone) is run again before it counts as failed."""

_LOCAL = re.compile(r"local:([1-9][0-9]{0,3})")
_RAY = re.compile(r"ray://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}")
_RAY_NICENESS = "RAY_worker_niceness"
"""Ray starts its task workers at niceness 15 unless a task's runtime environment sets this variable."""


def _first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message: Ray's messages run to pages."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@dataclass(frozen=True)
class WorkerSpec:
    """Parsed `--workers`: `local:N` (N processes here) or `ray://HEAD:PORT` (a Ray cluster's client port)."""

    text: str
    processes: int | None = None
    ray_address: str | None = None


def parse_workers(text: str) -> WorkerSpec:
    """`local:N` or `ray://HOST:PORT`; anything else is an InputError naming what was expected."""
    if match := _LOCAL.fullmatch(text):
        return WorkerSpec(text, processes=int(match.group(1)))
    if _RAY.fullmatch(text):
        return WorkerSpec(text, ray_address=text)
    raise InputError(f"--workers {text!r}: expected local:N (N from 1 to 9999 processes on this machine) or "
                     "ray://HOST:PORT (a Ray cluster's client address, e.g. ray://head:10001)")


@dataclass(frozen=True)
class Unit:
    """One (recipe, target) build, self-contained so it can be pickled to another process or machine."""

    index: int
    recipe: Recipe  # loaded from an absolute path: its relative paths resolve the same in any working directory
    target: str
    records_dir: Path | None = None
    sign_key: Path | None = None
    task_workers: int = 1  # workers its tuning may be split over


@dataclass
class UnitOutcome:
    """What a unit returned: the build's JSON summary (one target), or why it has none."""

    index: int
    summary: dict[str, Any] | None
    error: str | None = None
    exit_code: int = 0  # 2: bad input, 1: build error, 0: built (its target may still have failed)
    attempts: int = 1


def run_unit(unit: Unit) -> UnitOutcome:
    """Build one target of one recipe in this process; progress goes to stdout, prefixed by recipe/target."""
    from edgetune.pipeline import build

    prefix = f"[{unit.recipe.name}/{unit.target}]"

    def say(event: Event) -> None:
        if event.task is None:
            print(f"{prefix} {event.message}", flush=True)
        elif event.task.trials_done == event.task.trials_planned:
            task = event.task
            print(f"{prefix} task {task.index}/{task.total} {task.task}: {task.trials_done} trials", flush=True)

    try:
        result = build(unit.recipe, [unit.target], say, unit.records_dir, unit.sign_key,
                       _shard_pool(unit.task_workers), write_summary=False)
    except EdgetuneError as exc:
        return UnitOutcome(unit.index, None, str(exc), exc.exit_code)
    except Exception as exc:  # a crash inside TVM or a toolchain: this unit failed, the release goes on
        return UnitOutcome(unit.index, None, f"{type(exc).__name__}: {exc}", 1)
    return UnitOutcome(unit.index, result.to_json())


def _ray_task(ray: Any, function: Any) -> Any:
    """`function` as a Ray task of one CPU, run again on a lost worker, in a worker at this process's niceness.
    Ray's own default, niceness 15, left each unit 4% of a core beside two busy programs at niceness 0 (a
    release of four 2-trial units took 408 s instead of 46): on a machine that does other work a release
    crawled, and every program of normal priority disturbed its timings."""
    same_priority = {"env_vars": {_RAY_NICENESS: str(os.nice(0))}}
    return ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False, runtime_env=same_priority)(function)


def _shard_pool(workers: int) -> ShardPool | None:
    """Inside a unit: Ray tasks when the unit runs on Ray, else processes of its own; None for one worker."""
    if workers < 2:
        return None
    if ray_installed():
        import ray

        if ray.is_initialized():
            return RayShardPool(ray, workers)
    return ProcessShardPool(workers)


class ProcessShardPool:
    """Shard jobs on spawned processes; a worker that dies breaks the pool, so every unfinished job runs
    again on a new one (at most RETRIES times), resuming from its shard store."""

    def __init__(self, size: int):
        self.size = size

    def run_shards(self, jobs: list[ShardJob]) -> list[ShardOutcome | str]:
        from edgetune.tuning.shards import run_shard

        outcomes: dict[int, ShardOutcome | str] = {}
        attempts = [0] * len(jobs)
        pending = list(range(len(jobs)))
        while pending:
            with ProcessPoolExecutor(min(self.size, len(pending)), mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(run_shard, jobs[i]): i for i in pending}
                pending = []
                for future, i in futures.items():
                    attempts[i] += 1
                    try:
                        outcomes[i] = future.result()
                    except BrokenProcessPool:
                        if attempts[i] > RETRIES:
                            outcomes[i] = f"its worker was lost {attempts[i]} times"
                        else:
                            pending.append(i)
                    except Exception as exc:  # the job itself raised: its tasks keep what it committed
                        outcomes[i] = _first_line(exc)
        return [outcomes[i] for i in range(len(jobs))]


class RayShardPool:
    """Shard jobs as Ray tasks of the cluster the unit runs on; Ray reruns a job whose worker died."""

    def __init__(self, ray: Any, size: int):
        from edgetune.tuning.shards import run_shard

        self.ray = ray
        self.size = size
        self.remote = _ray_task(ray, run_shard)

    def run_shards(self, jobs: list[ShardJob]) -> list[ShardOutcome | str]:
        refs = [self.remote.remote(job) for job in jobs]
        outcomes: list[ShardOutcome | str] = []
        for ref in refs:
            try:
                outcomes.append(self.ray.get(ref))
            except self.ray.exceptions.RayTaskError as exc:  # the job raised
                outcomes.append(_first_line(exc.cause if getattr(exc, "cause", None) else exc))
            except self.ray.exceptions.RayError as exc:  # lost more than RETRIES times, or the cluster is gone
                outcomes.append(f"Ray gave up on it: {_first_line(exc)}")
        return outcomes


class Executor(Protocol):
    """Runs units somewhere; the release's scheduler decides which are ready."""

    slots: int  # units (or shards of one) that can run at once

    def submit(self, unit: Unit) -> None: ...

    def wait(self) -> list[UnitOutcome]:
        """Block until at least one submitted unit has finished; their outcomes (lost workers are retried)."""

    def close(self) -> None: ...


class ProcessPool:
    """N spawned processes on this machine. A killed worker breaks the whole pool: the pool is replaced and
    every unit that was running is submitted again (at most RETRIES times each)."""

    def __init__(self, processes: int):
        self.processes = self.slots = processes
        self.pool = self._new_pool()
        self.running: dict[Future, Unit] = {}
        self.attempts: dict[int, int] = {}

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.processes, mp_context=get_context("spawn"))

    def submit(self, unit: Unit) -> None:
        self.attempts[unit.index] = self.attempts.get(unit.index, 0) + 1
        self.running[self.pool.submit(run_unit, unit)] = unit

    def wait(self) -> list[UnitOutcome]:
        outcomes: list[UnitOutcome] = []
        while not outcomes and self.running:
            done, _ = wait_futures(list(self.running), return_when=FIRST_COMPLETED)
            lost = []
            for future in done:
                unit = self.running.pop(future)
                try:
                    outcome = future.result()
                except BrokenProcessPool:
                    lost.append(unit)
                    continue
                outcome.attempts = self.attempts[unit.index]
                outcomes.append(outcome)
            if lost:
                outcomes.extend(self._resubmit(lost + list(self.running.values())))
        return outcomes

    def _resubmit(self, lost: list[Unit]) -> list[UnitOutcome]:
        """A new pool for the units a dead worker took down; those out of retries fail."""
        self.running.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._new_pool()
        given_up = []
        for unit in lost:
            if self.attempts[unit.index] > RETRIES:
                given_up.append(UnitOutcome(unit.index, None, f"its worker was lost {self.attempts[unit.index]} "
                                                              "times", 1, self.attempts[unit.index]))
            else:
                self.submit(unit)
        return given_up

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class RayPool:
    """Units as Ray tasks: on a local Ray with N CPUs (`local:N`), or on a cluster (`ray://HEAD:PORT`). Ray runs
    a task again elsewhere when its worker process or node dies (max_retries)."""

    def __init__(self, spec: WorkerSpec):
        import ray

        self.ray = ray
        if spec.ray_address:
            _connect_to_cluster(ray, spec)
        else:
            ray.init(address="local", num_cpus=spec.processes, include_dashboard=False,
                     object_store_memory=_RAY_OBJECT_STORE_BYTES, log_to_driver=True)
        self.slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.remote = _ray_task(ray, run_unit)
        self.running: dict[Any, Unit] = {}

    def submit(self, unit: Unit) -> None:
        self.running[self.remote.remote(unit)] = unit

    def wait(self) -> list[UnitOutcome]:
        done, _ = self.ray.wait(list(self.running), num_returns=1)
        outcomes = []
        for ref in done:
            unit = self.running.pop(ref)
            try:
                outcomes.append(self.ray.get(ref))
            except self.ray.exceptions.RayError as exc:  # lost more than RETRIES times, or the cluster is gone
                outcomes.append(UnitOutcome(unit.index, None, f"Ray gave up on it: {_first_line(exc)}", 1))
        return outcomes

    def close(self) -> None:
        self.ray.shutdown()


def _connect_to_cluster(ray: Any, spec: WorkerSpec) -> None:
    """Connects to `ray://HEAD:PORT`, trying again while the head is still starting its client server (a head
    that has just come up refuses the first clients for a few seconds); a cluster that stays unreachable is an
    error that names the address, not a traceback."""
    last_problem = ""
    for attempt in range(_CONNECT_ATTEMPTS):
        if attempt:
            time.sleep(_CONNECT_BACKOFF_S * attempt)
        try:
            ray.init(address=spec.ray_address, log_to_driver=True)
            return
        except ConnectionAbortedError as exc:  # the head answered but could not start this client's server yet
            last_problem = _first_line(exc)
            ray.shutdown()
        except ConnectionError as exc:  # nothing answered: Ray has already retried for its connection timeout
            raise BuildError(f"--workers {spec.text}: no Ray cluster answered ({_first_line(exc)}); is its head "
                             "running with the client server on that port?") from None
    raise BuildError(f"--workers {spec.text}: could not connect to the Ray cluster after {_CONNECT_ATTEMPTS} "
                     f"attempts (the head kept refusing the client: {last_problem})")


_CONNECT_ATTEMPTS = 4
_CONNECT_BACKOFF_S = 5.0

_RAY_OBJECT_STORE_BYTES = 128 * 1024 * 1024
"""Units return small JSON summaries; artifacts and records go to the shared directory, not the object store."""


def ray_installed() -> bool:
    """Whether the optional `ray` extra is importable here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def open_executor(spec: WorkerSpec) -> Executor:
    """Ray when the spec names a cluster or Ray is installed; otherwise (local:N without Ray) a process pool."""
    if spec.ray_address and not ray_installed():
        raise InputError(f"--workers {spec.text}: Ray is not installed here; pip install \"edgetune[ray]\"")
    if spec.ray_address or (ray_installed() and os.environ.get("EDGETUNE_NO_RAY") != "1"):
        return RayPool(spec)
    return ProcessPool(spec.processes or 1)
