"""A device over TVM RPC, through its tracker key: candidates are linked here for it and timed there
(tuning/remote.py's runner), and the packaged model is timed and run there (fleet/session.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgetune.devices.base import Device
from edgetune.fleet.endpoints import RemoteDevice, device_summary
from edgetune.fleet.tracker import require_servers

if TYPE_CHECKING:
    from edgetune.package.manifest import Manifest
    from edgetune.package.verify import OutputCheck


class RpcDevice(Device):
    """The board (or emulated board) registered under `remote.key` at `remote.tracker`."""

    def __init__(self, arch: str, remote: RemoteDevice) -> None:
        super().__init__(arch)
        self.remote = remote

    @property
    def where(self) -> str:
        return self.remote.where

    def check_reachable(self, trials_per_task: int | None) -> None:
        require_servers(self.remote.tracker, self.remote.key)

    def tuning_builder_runner(self, cores: int, stop: threading.Event) -> tuple[Any, Any]:
        from edgetune.tuning.tune import remote_builder_runner

        return remote_builder_runner(self.remote, cores, self.remote.device, stop)

    def link_compiler(self) -> str:
        return self.remote.compiler

    def latency_ms(self, library: Path, inputs: list[np.ndarray], min_total_s: float = 1.0) -> float:
        from edgetune.fleet.session import remote_latency_ms

        return remote_latency_ms(self.remote, library, inputs, min_total_s)

    def output_check(self, artifact_dir: Path, manifest: Manifest) -> tuple[str, OutputCheck]:
        from edgetune.package.verify import check_remote_outputs

        return f"TVM's runtime on the device, {self.where}", check_remote_outputs(artifact_dir, manifest, self.remote)

    def summary(self) -> dict:
        return device_summary(self.arch, self.remote)
