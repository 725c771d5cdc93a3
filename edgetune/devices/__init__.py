"""Where a target's code runs, decided in one place (`open_device`): this machine's CPU, a device over
TVM RPC, or none (compiled here, run nowhere). The stages ask the device (base.py), never which it is."""

from __future__ import annotations

from edgetune.devices.base import Device
from edgetune.devices.local import LocalDevice
from edgetune.devices.none import UnreachableDevice
from edgetune.devices.rpc import RpcDevice
from edgetune.fleet.endpoints import RemoteDevice
from edgetune.profiles import DeviceProfile
from edgetune.recipe import FleetTarget
from edgetune.toolchains import Toolchain

__all__ = ["Device", "LocalDevice", "RpcDevice", "UnreachableDevice", "open_device"]


def open_device(target: FleetTarget, profile: DeviceProfile, toolchain: Toolchain,
                remote: RemoteDevice | None) -> Device:
    """The target's device: its RPC connection when it has one (fleet.endpoints.remote_device); else this
    machine when it is this machine's CPU (a local target, a CPU profile, a native toolchain); else none."""
    if remote is not None:
        return RpcDevice(toolchain.arch, remote)
    if target.is_local and profile.device == "cpu" and toolchain.native:
        return LocalDevice(toolchain.arch, profile.hardware.cores, profile.cpu_threads)
    return UnreachableDevice(toolchain.arch, target.name, profile.device)
