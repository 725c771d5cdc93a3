"""The packaged model on a device over RPC: its latency there, and its output on the sample input.

The library sent is the artifact's own `model.so` (linked for the device), loaded by the device's
TVM runtime; the session goes through the tracker like any measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from edgetune.fleet import tracker
from edgetune.fleet.endpoints import RemoteDevice

T = TypeVar("T")

_MODEL_SESSION_S = 300.0
"""Upper bound on one session with the whole model: upload (weights included), load, time or run."""


def _on_device(remote: RemoteDevice, library: Path, use: Callable[..., T]) -> T:
    """Upload `library`, load it in a VM on the device, and hand the VM and device to `use`."""
    from tvm import relax, rpc

    tracker.require_servers(remote.tracker, remote.key)
    session = rpc.connect_tracker(remote.tracker_host, remote.tracker_port).request(
        remote.key, session_timeout=max(_MODEL_SESSION_S, remote.timeout_s)
    )
    session.upload(str(library), library.name)
    device = session.device(remote.device, 0)
    return use(relax.VirtualMachine(session.load_module(library.name), device), device)


def remote_latency_ms(remote: RemoteDevice, library: Path, inputs: list[np.ndarray],
                      min_total_s: float = 1.0) -> float:
    """Median latency of the library on the device, timed there (as `time_model` does here)."""
    from edgetune.runtime import time_model

    return _on_device(remote, library, lambda vm, device: time_model(vm, inputs, device, min_total_s))


def remote_outputs(remote: RemoteDevice, library: Path, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The library's outputs for `inputs`, computed on the device."""
    from edgetune.runtime import run

    return _on_device(remote, library, lambda vm, device: run(vm, inputs, device))
