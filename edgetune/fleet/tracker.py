"""The RPC tracker: start one on this machine for a recipe, and ask any tracker what it serves.

Queries speak the tracker's protocol directly (as `python -m tvm.exec.query_rpc_tracker` does)
with a short socket timeout: TVM's client retries for a minute, which would hang `fleet status`
and the build's checks when a tracker is down.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from edgetune.errors import BuildError
from edgetune.fleet import processes
from edgetune.isolated import TORCH_REFUSED_DIR, environment_without_torch
from edgetune.recipe import TrackerSpec

_MARKER = "tvm.exec.rpc_tracker"


@dataclass(frozen=True)
class KeyStatus:
    """Servers registered under one key: total, free now, and requests waiting for one."""

    total: int
    free: int
    pending: int


@dataclass(frozen=True)
class TrackerSummary:
    address: str
    keys: dict[str, KeyStatus] = field(default_factory=dict)
    servers: list[tuple[str, str]] = field(default_factory=list)
    """(address:port, key) of every registered server."""

    def key(self, name: str) -> KeyStatus:
        return self.keys.get(name, KeyStatus(0, 0, 0))


def query(address: str, timeout_s: float = 5.0) -> TrackerSummary:
    """The tracker's summary; BuildError when nothing answers there as a tracker."""
    from tvm.rpc import base

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            if struct.unpack("<i", base.recvall(sock, 4))[0] != base.RPC_TRACKER_MAGIC:
                raise BuildError(f"{address} answers, but not as a TVM RPC tracker")
            base.sendjson(sock, [base.TrackerCode.SUMMARY])
            code, summary = base.recvjson(sock)
    except (OSError, RuntimeError, struct.error) as exc:
        raise BuildError(f"cannot reach the RPC tracker at {address}: {exc}") from None
    if code != base.TrackerCode.SUCCESS:
        raise BuildError(f"the RPC tracker at {address} refused a summary request")
    servers = [(":".join(map(str, s["addr"])), s["key"].split(":", 1)[1]) for s in summary["server_info"]]
    totals = Counter(key for _, key in servers)
    keys = {
        key: KeyStatus(totals.get(key, 0), queue["free"], queue["pending"])
        for key, queue in summary["queue_info"].items()
    }
    for key, total in totals.items():
        keys.setdefault(key, KeyStatus(total, 0, 0))
    return TrackerSummary(address, keys, sorted(servers))


def require_servers(address: str, key: str) -> int:
    """How many servers the tracker lists under `key`; BuildError naming the key when none."""
    total = query(address).key(key).total
    if total == 0:
        raise BuildError(
            f"no RPC server is registered under key '{key}' at the tracker {address}; start the device's "
            f"server (edgetune fleet up RECIPE for ssh connections, or python -m tvm.exec.rpc_server "
            f"--tracker {address} --key {key} on the device)"
        )
    return total


def wait_for_servers(address: str, key: str, count: int, timeout_s: float) -> bool:
    """Poll until the tracker lists at least `count` servers under `key`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if query(address, timeout_s=2.0).key(key).total >= count:
                return True
        except BuildError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def pid_file(fleet_dir: Path) -> Path:
    return fleet_dir / "tracker.pid"


def log_file(fleet_dir: Path) -> Path:
    return fleet_dir / "tracker.log"


def running(fleet_dir: Path) -> int | None:
    """The pid of the tracker `fleet up` started for this recipe, if it still runs."""
    return processes.running_pid(pid_file(fleet_dir), _MARKER)


def exposure_warning(what: str, host: str) -> str | None:
    """A warning when `host` is not a loopback address: TVM's RPC has no authentication, so whoever
    reaches a tracker or server bound there can run code on the device and fetch the model."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if loopback:
        return None
    return (f"warning: the {what} listens on {host}, not loopback; TVM's RPC has no authentication: anyone who "
            "can reach it can run code on the devices and fetch the model. Keep it on 127.0.0.1 with SSH tunnels "
            "(the default) unless this network is trusted")


def start(spec: TrackerSpec, fleet_dir: Path, timeout_s: float = 30.0) -> tuple[int, bool]:
    """Start the recipe's tracker, detached, bound to exactly `spec.host:spec.port`.

    Returns (pid, started): an already running one is kept. TVM's tracker would silently move to the
    next free port; `--port-end` pins it, so a port in use is an error naming it.
    """
    pid = running(fleet_dir)
    if pid is not None:
        return pid, False
    argv = [sys.executable, "-m", _MARKER, "--host", spec.host, "--port", str(spec.port),
            "--port-end", str(spec.port + 1)]
    environment = environment_without_torch(fleet_dir / TORCH_REFUSED_DIR, os.environ)
    process = processes.start_detached(argv, pid_file(fleet_dir), log_file(fleet_dir), environment)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            query(spec.address, timeout_s=1.0)
            return process.pid, True
        except BuildError:
            time.sleep(0.25)
    processes.stop(pid_file(fleet_dir), _MARKER)
    raise BuildError(f"the RPC tracker did not start on {spec.host}:{spec.port}; its log "
                     f"({log_file(fleet_dir)}) ends with:\n{processes.log_tail(log_file(fleet_dir))}")


def stop(fleet_dir: Path) -> int | None:
    """Stop the tracker `fleet up` started; the pid stopped, or None when none ran."""
    return processes.stop(pid_file(fleet_dir), _MARKER)
