"""Where a target's code runs is decided once, by open_device, from what the build knows of the target."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

import pytest

from edgetune.devices import LocalDevice, RpcDevice, UnreachableDevice, open_device
from edgetune.errors import BuildError
from edgetune.fleet.endpoints import EMULATED_NOTE, RemoteDevice
from edgetune.profiles import machine_isa, resolve_profile
from edgetune.recipe import FleetTarget
from edgetune.toolchains import Toolchain, resolve_toolchain

AARCH64 = Toolchain("aarch64", Path("aarch64-linux-gnu-gcc"), Path("aarch64-linux-gnu-g++"), "cross gcc")
"""What resolve_toolchain gives raspberry-pi-4 where the cross compiler is installed (only arch is read here)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_host_profile_runs_here() -> None:
    profile = resolve_profile("host", None)
    device = open_device(FleetTarget(name="host", profile="host"), profile, resolve_toolchain(profile), None)
    assert isinstance(device, LocalDevice) and device.runs_here and device.can_measure
    assert device.where.startswith("this build machine (") and f"{profile.hardware.cores} cores" in device.where
    assert device.link_compiler() is None  # TVM's default link, as the untuned model always was here
    assert device.summary() == {"arch": machine_isa(), "via": "local", "emulated": False, "key": None}
    device.check_reachable(4)


def test_cross_target_without_a_connection_runs_nowhere() -> None:
    target = FleetTarget(name="rpi4", profile="raspberry-pi-4")
    device = open_device(target, resolve_profile("raspberry-pi-4", None), AARCH64, None)
    assert isinstance(device, UnreachableDevice)
    assert not device.runs_here and not device.can_measure and device.where is None
    assert device.summary() == {"arch": "aarch64", "via": "local", "emulated": False, "key": None}
    device.check_reachable(0)  # compiled with the records its store holds: no device needed
    today = ("target 'rpi4': a aarch64/cpu device cannot be measured on this machine; give it an RPC connection, "
             "or set tuning.trials_per_task: 0 to compile it with the records its store already holds")
    for trials in (4, None):
        with pytest.raises(BuildError, match=re.escape(today)):
            device.check_reachable(trials)
    with pytest.raises(BuildError, match=re.escape(today)):
        device.tuning_builder_runner(2, threading.Event())


def test_gpu_profile_on_this_machine_runs_nowhere() -> None:
    profile = resolve_profile("a100", None)
    toolchain = Toolchain(machine_isa(), Path("gcc"), None, "gcc")
    device = open_device(FleetTarget(name="a100", profile="a100"), profile, toolchain, None)
    assert isinstance(device, UnreachableDevice)
    with pytest.raises(BuildError, match=f"a {machine_isa()}/cuda device cannot be measured on this machine"):
        device.check_reachable(1)


def test_target_with_a_connection_runs_over_rpc() -> None:
    tracker = f"127.0.0.1:{_free_port()}"  # nothing listens there
    target = FleetTarget(name="board", profile="raspberry-pi-4", connection={"rpc": {"tracker": tracker, "key": "rpi"}})
    remote = RemoteDevice("127.0.0.1", int(tracker.rpartition(":")[2]), "rpi", 30.0, "aarch64-linux-gnu-gcc")
    device = open_device(target, resolve_profile("raspberry-pi-4", None), AARCH64, remote)
    assert isinstance(device, RpcDevice) and device.can_measure and not device.runs_here
    assert device.where == f"rpc key rpi via {tracker}"
    assert device.summary() == {"arch": "aarch64", "via": "rpc", "emulated": False, "key": "rpi"}
    with pytest.raises(BuildError, match=re.escape(f"cannot reach the RPC tracker at {tracker}")):
        device.check_reachable(0)  # even without tuning: the device is timed and verified over RPC


def test_an_emulated_board_says_so_where_it_was_measured() -> None:
    remote = RemoteDevice("127.0.0.1", 9190, "rpi", 30.0, "aarch64-linux-gnu-gcc", emulated=True)
    device = RpcDevice("aarch64", remote)
    assert device.where == f"rpc key rpi via 127.0.0.1:9190, {EMULATED_NOTE}"
    assert device.summary() == {"arch": "aarch64", "via": "rpc", "emulated": True, "key": "rpi",
                                "note": EMULATED_NOTE}
