"""Where a fleet target is measured: a tracker address and a key, from its recipe connection.

A recipe names devices by `rpc` (a server someone registered) or `ssh` (a server edgetune starts);
either way, tuning and timing go through the tracker. `--rpc-tracker/--rpc-key` on `edgetune build`
replace one target's connection, as tvmc's flags of the same names did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from edgetune.errors import InputError
from edgetune.recipe import FleetTarget, Recipe, RpcConnection, RpcSpec


@dataclass(frozen=True)
class RemoteDevice:
    """A device measured over TVM RPC: its tracker, its key, and how candidates are linked for it."""

    tracker_host: str
    tracker_port: int
    key: str
    timeout_s: float
    """Seconds one RPC session may last; a hung server costs this once."""
    compiler: str
    """The C compiler (cross, for another architecture) that links candidates into shared objects."""
    device: str = "cpu"
    """TVM's device type on the board: "cpu", "cuda", "opencl"."""
    emulated: bool = False
    """The key is served by a board `edgetune fleet up --emulate` runs under qemu on this machine."""

    @property
    def tracker(self) -> str:
        return f"{self.tracker_host}:{self.tracker_port}"

    @property
    def where(self) -> str:
        """How the manifest names the place of a measurement (an emulated board's times are not the device's)."""
        if self.emulated:
            return f"rpc key {self.key} via {self.tracker}, {EMULATED_NOTE}"
        return f"rpc key {self.key} via {self.tracker}"


EMULATED_NOTE = "an emulated board (qemu-aarch64 on the build machine): latencies measured there are not the device's"


def device_summary(arch: str, remote: RemoteDevice | None) -> dict:
    """The summary's `device` of a target: where it ran, how it was reached, and whether it was emulated."""
    summary = {"arch": arch, "via": "rpc" if remote else "local", "emulated": bool(remote and remote.emulated),
               "key": remote.key if remote else None}
    if summary["emulated"]:
        summary["note"] = EMULATED_NOTE
    return summary


def tracker_address(recipe: Recipe, target: FleetTarget) -> str | None:
    """host:port of the tracker the target is measured through; None for a local target."""
    connection = target.connection
    if connection is None:
        return None
    if connection.rpc is not None:
        return connection.rpc.tracker
    assert connection.ssh is not None
    if connection.ssh.tracker is not None:
        return connection.ssh.tracker
    assert recipe.tracker is not None  # load_recipe reports an ssh connection without a tracker
    return recipe.tracker.address


def remote_device(recipe: Recipe, target: FleetTarget, device: str, compiler: Path) -> RemoteDevice | None:
    """The target's RPC endpoint, or None when it is measured on this machine."""
    address = tracker_address(recipe, target)
    if address is None or target.connection is None:
        return None
    spec = target.connection.rpc or target.connection.ssh
    assert spec is not None
    from edgetune.fleet.emulated import serves_emulated

    host, _, port = address.rpartition(":")
    emulated = serves_emulated(address, spec.key)
    return RemoteDevice(host, int(port), spec.key, spec.timeout_s, str(compiler), device, emulated)


def override_connection(recipe: Recipe, only: list[str] | None, tracker: str | None, key: str | None) -> Recipe:
    """The recipe with one target reached at `tracker` under `key` (the build's --rpc-tracker/--rpc-key)."""
    if tracker is None and key is None:
        return recipe
    if tracker is None or key is None:
        raise InputError("--rpc-tracker and --rpc-key go together: give both, or neither")
    chosen = [t for t in recipe.fleet if not only or t.name in only]
    if len(chosen) != 1:
        names = ", ".join(t.name for t in chosen)
        raise InputError(f"--rpc-tracker/--rpc-key set the connection of one target; choose it with --target "
                         f"(these would be built: {names})")
    target = chosen[0]
    old = target.connection.rpc or target.connection.ssh if target.connection else None
    try:
        spec = RpcSpec(tracker=tracker, key=key, **({"timeout_s": old.timeout_s} if old else {}))
    except ValidationError as exc:
        raise InputError([f"--rpc-{e['loc'][0]}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()])
    replaced = target.model_copy(update={"connection": RpcConnection(rpc=spec)})
    return recipe.model_copy(update={"fleet": [replaced if t is target else t for t in recipe.fleet]})


def fleet_dir(recipe: Recipe) -> Path:
    """Pid files and logs of what `edgetune fleet up` started on this machine for the recipe."""
    return recipe.output_dir / recipe.name / "fleet"
