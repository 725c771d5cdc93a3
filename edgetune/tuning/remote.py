"""Measuring candidates on a device over TVM RPC, in a way that survives the device.

Candidates are linked here into shared objects with the target's (cross) compiler, so a board
needs no compiler of its own (TVM's default `.tar` export makes the RPC server link it). Each
batch goes to MetaSchedule's RPCRunner, one connection per server the tracker lists under the
key. Whatever lost contact with its server (a timeout, a refused or broken connection) is sent
once more, to whichever server the tracker hands out next; what fails again is recorded as a
failure, never as a fast result. When the key has no server left, the runner stops the tuning
loop and names the key: a batch that finds no server at all is not recorded (resuming measures it),
one that loses the last server midway is committed first (what was measured, and the rest as
failures). While a batch is measured the tracker is asked every 2 s whether the key still has a
server: a board killed mid-measurement is noticed then, not after the session timeout.
"""

from __future__ import annotations

import threading
import time

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.runner import (
    EvaluatorConfig,
    PyRunner,
    PyRunnerFuture,
    RPCConfig,
    RPCRunner,
    RunnerFuture,
    RunnerInput,
    RunnerResult,
)
from tvm.s_tir.meta_schedule.utils import remove_build_dir

from edgetune.errors import BuildError
from edgetune.fleet import tracker
from edgetune.fleet.endpoints import RemoteDevice
from edgetune.tuning.measurements import TimingNoise
from edgetune.tuning.worker_pool import WorkerPool

_CONNECT_GRACE_S = 10.0
"""Beyond the session timeout: time to get a server from the tracker and connect to it."""

_TRACKER_POLL_S = 2.0
"""While a batch is measured, how often the tracker is asked whether the key still has a server."""

_DONE_POLL_S = 0.01
"""How often a batch's futures are checked (a batch takes a second or more: 1% or less added)."""

_LOST_WHILE_MEASURING = "RPCRunner: Timeout cut short: the tracker lists no server under the key any more"
"""The error of a measurement cut off because its server left the tracker (read as a failed connection)."""

_CONNECT_FAILED = (
    "RPCRunner: Timeout",  # no answer within the session timeout and a grace: a hung or unreachable server
    "Cannot request",
    "Unable to connect to the tracker",
    "Connection refused",
)
"""Errors that say no session with a server could be had."""

_SESSION_BROKEN = (
    "code=kShutdown",  # the server's end of the session closed: killed, or crashed by the candidate
    "RPCCode::kReturn) is false: code=1",
    "Connection reset",
    "Broken pipe",
    "RPCSessionTimeoutError",
)
"""Errors that say a session ended before the measurement did."""


class DeviceLost(BuildError):
    """No server left under the target's key: tuning stopped, every committed record kept."""


def connect_failed(result: RunnerResult) -> bool:
    """True when the measurement got no session with a server."""
    return result.error_msg is not None and any(sign in result.error_msg for sign in _CONNECT_FAILED)


def lost_contact(result: RunnerResult) -> bool:
    """True when a measurement failed with its server rather than with its code: worth a try elsewhere."""
    return connect_failed(result) or (
        result.error_msg is not None and any(sign in result.error_msg for sign in _SESSION_BROKEN)
    )


def _wait_for(futures: list[RunnerFuture], timeout_s: float) -> bool:
    """Waits up to `timeout_s` for every future (MetaSchedule's futures can only be polled); True when all are done."""
    deadline = time.monotonic() + timeout_s
    while not all(future.done() for future in futures):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_DONE_POLL_S)
    return True


def _run_secs(result: RunnerResult) -> list:
    """A result's run times; none for a failed one."""
    return [] if result.error_msg is not None else list(result.run_secs or [])


@derived_object
class _Measured(PyRunnerFuture):
    """A measurement that is already finished (the retrying runner waits for its batch)."""

    def __init__(self, result: RunnerResult) -> None:
        super().__init__()
        self.measured = result

    def done(self) -> bool:
        return True

    def result(self) -> RunnerResult:
        return self.measured


@derived_object
class RetryingRPCRunner(PyRunner):
    """RPCRunner on the device's key that re-sends, once, what lost contact with its server.

    A candidate that crashes its session is retried too (the runner cannot tell it from a server
    that died), and then recorded as the failure it is.

    A timing near the task's best that something else on the device disturbed is taken again
    (measurements.TimingNoise, `noise`). `stop` is the tuning loop's stop request: set when the key has no server left,
    with `lost` saying so. `timing`: how each candidate is timed (MetaSchedule's default when left out).
    """

    def __init__(self, remote: RemoteDevice, stop: threading.Event, timing: EvaluatorConfig | None = None) -> None:
        super().__init__()
        self.remote = remote
        self.stop = stop
        self.lost: str | None = None
        self.noise = TimingNoise()
        servers = tracker.require_servers(remote.tracker, remote.key)
        config = RPCConfig(remote.tracker_host, remote.tracker_port, remote.key,
                           session_timeout_sec=remote.timeout_s)
        self.inner = RPCRunner(config, timing, max_workers=servers)
        # RPCRunner's pool waits forever on a server that hangs, and its workers import PyTorch; this one
        # gives up after the session, and its workers do not.
        self.inner.pool.shutdown()
        self.inner.pool = WorkerPool(servers, timeout=remote.timeout_s + _CONNECT_GRACE_S)

    def run(self, runner_inputs: list[RunnerInput]) -> list[RunnerFuture]:
        if self._servers_left() == 0:  # requests for a key without servers would wait out the timeout
            self._lose("the tracker lists none")
            for runner_input in runner_inputs:
                remove_build_dir(runner_input.artifact_path)
            raise DeviceLost(self.lost)
        results = self._measure(runner_inputs)
        again = [i for i, r in enumerate(results) if lost_contact(r)]
        if again:
            if self._servers_left() == 0:
                self._lose("the tracker lists none")
            else:
                retried = self._measure([runner_inputs[i] for i in again])
                for i, result in zip(again, retried):
                    results[i] = result
                if all(connect_failed(r) for r in retried):
                    self._lose("every retry failed to connect")
        return [_Measured(self.noise.quietest(r, lambda i=i: self._measure([runner_inputs[i]])[0], _run_secs))
                for i, r in enumerate(results)]

    def _measure(self, runner_inputs: list[RunnerInput]) -> list[RunnerResult]:
        """The batch's results; what was still running or waiting when the key's last server left the tracker
        is cut off then, not after the session timeout, and reads as a failed connection."""
        futures = self.inner.run(runner_inputs)
        unfinished = self._wait_while_a_server_is_listed(futures)
        while not all(future.done() for future in futures):
            self.inner.pool.cut_running()  # a job that starts after a cut is cut at the next one
            _wait_for(futures, _TRACKER_POLL_S)
        results = [future.result() for future in futures]
        return [RunnerResult(None, error_msg=_LOST_WHILE_MEASURING) if i in unfinished and r.error_msg else r
                for i, r in enumerate(results)]

    def _wait_while_a_server_is_listed(self, futures: list[RunnerFuture]) -> set[int]:
        """Waits for `futures`; returns the indices of those not done once the tracker answered twice in a row that
        the key has no server (a board killed mid-measurement, a key that emptied while a request waited)."""
        empty_answers = 0
        while not _wait_for(futures, _TRACKER_POLL_S):
            # a tracker that does not answer now (None) says nothing about the servers
            empty_answers = empty_answers + 1 if self._servers_listed(_TRACKER_POLL_S) == 0 else 0
            if empty_answers >= 2:
                return {i for i, future in enumerate(futures) if not future.done()}
        return set()

    def close(self) -> None:
        self.inner.pool.shutdown()

    def _servers_left(self) -> int:
        """Servers under the key; none when the tracker does not answer."""
        listed = self._servers_listed()
        return 0 if listed is None else listed

    def _servers_listed(self, timeout_s: float = 5.0) -> int | None:
        """Servers the tracker lists under the key; None when it does not answer within `timeout_s`."""
        try:
            return tracker.query(self.remote.tracker, timeout_s=timeout_s).key(self.remote.key).total
        except BuildError:
            return None

    def _lose(self, why: str) -> None:
        self.lost = f"no RPC server left under key '{self.remote.key}' at the tracker {self.remote.tracker} ({why})"
        self.stop.set()
