"""`edgetune fleet status`: per key, the servers a tracker lists; per device, whether it is healthy.

Servers are counted as `python -m tvm.exec.query_rpc_tracker` counts them (total registered, free
now, requests pending). An `ssh` device is also asked over SSH whether the server `fleet up`
started still runs (and what its log says when it does not).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgetune.errors import BuildError
from edgetune.fleet import provision, ssh, tracker, tunnel
from edgetune.fleet.endpoints import fleet_dir, tracker_address
from edgetune.recipe import FleetTarget, Recipe


@dataclass(frozen=True)
class TargetStatus:
    name: str
    connection: str  # "local", "rpc" or "ssh"
    key: str | None
    tracker: str | None
    servers: tracker.KeyStatus | None  # None: the tracker did not answer
    health: str
    healthy: bool


@dataclass(frozen=True)
class FleetStatus:
    trackers: dict[str, tracker.TrackerSummary | str]
    """Each tracker the recipe uses: its summary, or why it did not answer."""
    local_tracker_pid: int | None
    """The tracker `fleet up` started for this recipe, if it runs."""
    targets: list[TargetStatus]

    @property
    def ok(self) -> bool:
        return all(t.healthy for t in self.targets)


def fleet_status(recipe: Recipe) -> FleetStatus:
    """Ask every tracker the recipe names, and every ssh device, how things stand."""
    addresses = {tracker_address(recipe, t) for t in recipe.fleet} - {None}
    if recipe.tracker is not None:
        addresses.add(recipe.tracker.address)
    trackers: dict[str, tracker.TrackerSummary | str] = {}
    for address in sorted(addresses):
        try:
            trackers[address] = tracker.query(address)
        except BuildError as exc:
            trackers[address] = str(exc)
    targets = [_target_status(recipe, t, trackers) for t in recipe.fleet]
    return FleetStatus(trackers, tracker.running(fleet_dir(recipe)), targets)


def _target_status(recipe: Recipe, target: FleetTarget, trackers: dict) -> TargetStatus:
    connection = target.connection
    if connection is None:
        return TargetStatus(target.name, "local", None, None, None, "measured on this machine", True)
    address = tracker_address(recipe, target)
    summary = trackers[address]
    servers = summary.key(connection.key) if isinstance(summary, tracker.TrackerSummary) else None
    registered = servers is not None and servers.total > 0
    kind = "rpc" if connection.rpc is not None else "ssh"
    notes = [f"{servers.total} server(s) under key '{connection.key}'" if servers else "tracker not answering"]
    healthy = registered
    if connection.ssh is not None:
        device, device_ok = _device_health(recipe, target)
        notes.append(device)
        healthy = healthy and device_ok
    return TargetStatus(target.name, kind, connection.key, address, servers, "; ".join(notes), healthy)


def _device_health(recipe: Recipe, target: FleetTarget) -> tuple[str, bool]:
    """Whether the server `fleet up` started on the device still runs, asked over SSH."""
    assert target.connection is not None and target.connection.ssh is not None
    spec = target.connection.ssh
    helper = tunnel.running(fleet_dir(recipe), target.name)
    via = f", via SSH tunnel (helper pid {helper})" if helper else ""
    try:
        with ssh.connect(target.name, spec, recipe.base_dir) as client:
            state = provision.server_status(client, spec)
    except BuildError as exc:
        return f"device unreachable: {exc}", False
    if state["pid"] is None:
        log = f"; its log ends: {state['log'].splitlines()[-1]}" if state["log"] else ""
        return f"{spec.host}: no RPC server running (edgetune fleet up starts it){log}", False
    return f"{spec.host}: RPC server running (pid {state['pid']}){via}", True
