"""An SSH tunnel for a device that cannot reach the tracker: a detached helper process holds it.

Both directions of TVM RPC go through the one SSH connection:
- device -> tracker: the device's `127.0.0.1:R` is forwarded here (`request_port_forward`) and on to
  the tracker, so the device's server registers at `--tracker 127.0.0.1:R`;
- client -> device: this machine's `127.0.0.1:P` is forwarded to the device's `127.0.0.1:P`, where
  its server listens, and the server reports `127.0.0.1` as its address, so the tracker sends this
  machine's clients into the tunnel.
The device's server therefore listens on its loopback only. `python -m edgetune.fleet.tunnel
CONFIG.json` is the helper; `fleet up` starts it (pid file under the recipe's fleet directory) and
`fleet down` stops it.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from edgetune.errors import BuildError
from edgetune.fleet import processes, ssh
from edgetune.recipe import SshSpec

_MARKER = "edgetune.fleet.tunnel"
_KEEPALIVE_S = 15


@dataclass(frozen=True)
class Tunnel:
    pid: int
    remote_port: int
    """The device's loopback port that reaches the tracker."""
    local_port: int
    """This machine's loopback port that reaches the device's server (the same port on the device)."""


def _files(fleet_dir: Path, target: str) -> tuple[Path, Path, Path, Path]:
    stem = fleet_dir / f"tunnel-{target}"
    return (stem.with_suffix(".pid"), stem.with_suffix(".log"), stem.with_suffix(".json"),
            stem.with_suffix(".ready"))


def start(target: str, spec: SshSpec, base_dir: Path, tracker: str, fleet_dir: Path,
          timeout_s: float = 60.0) -> Tunnel:
    """Start the helper for `target` and wait until both forwards are in place."""
    pid_file, log_file, config_file, ready_file = _files(fleet_dir, target)
    stop(fleet_dir, target)
    ready_file.unlink(missing_ok=True)
    fleet_dir.mkdir(parents=True, exist_ok=True)
    config_file.write_text(json.dumps({
        "target": target, "ssh": spec.model_dump(mode="json"), "base_dir": str(base_dir),
        "tracker": tracker, "ready": str(ready_file),
    }))
    process = processes.start_detached([sys.executable, "-m", _MARKER, str(config_file)], pid_file, log_file)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if ready_file.is_file():
            ports = json.loads(ready_file.read_text())
            return Tunnel(process.pid, ports["remote_port"], ports["local_port"])
        time.sleep(0.1)
    stop(fleet_dir, target)
    raise BuildError(f"target '{target}': the SSH tunnel to the tracker did not come up; its log ({log_file}) "
                     f"ends with:\n{processes.log_tail(log_file)}")


def running(fleet_dir: Path, target: str) -> int | None:
    return processes.running_pid(_files(fleet_dir, target)[0], _MARKER)


def stop(fleet_dir: Path, target: str) -> int | None:
    """Stop the target's helper (the SSH connection, and so both forwards, end with it)."""
    pid_file, _, _, ready_file = _files(fleet_dir, target)
    ready_file.unlink(missing_ok=True)
    return processes.stop(pid_file, _MARKER)


def _splice(a, b) -> None:
    """Copy bytes both ways between two sockets or channels until either side closes."""
    def copy(source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    threading.Thread(target=copy, args=(a, b), daemon=True).start()
    threading.Thread(target=copy, args=(b, a), daemon=True).start()


def main(config_path: str) -> None:
    """The helper: hold the SSH connection and its two forwards until it drops or the helper is stopped."""
    config = json.loads(Path(config_path).read_text())
    tracker_host, _, tracker_port = config["tracker"].rpartition(":")
    client = ssh.connect(config["target"], SshSpec.model_validate(config["ssh"]), Path(config["base_dir"]))
    transport = client.get_transport()
    assert transport is not None
    transport.set_keepalive(_KEEPALIVE_S)

    def to_tracker(channel: paramiko.Channel, origin: tuple, server: tuple) -> None:
        try:
            sock = socket.create_connection((tracker_host, int(tracker_port)), timeout=10)
            sock.settimeout(None)  # the tracker connection idles between requests for as long as the server lives
            _splice(channel, sock)
        except OSError as exc:
            print(f"cannot reach the tracker at {config['tracker']}: {exc}", flush=True)
            channel.close()

    remote_port = transport.request_port_forward("127.0.0.1", 0, to_tracker)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(1.0)
    local_port = listener.getsockname()[1]
    ready = Path(config["ready"])
    ready.with_suffix(".tmp").write_text(json.dumps({"remote_port": remote_port, "local_port": local_port}))
    ready.with_suffix(".tmp").replace(ready)  # whole, or not at all: `start` polls for it
    print(f"device 127.0.0.1:{remote_port} -> tracker {config['tracker']}; "
          f"127.0.0.1:{local_port} -> device 127.0.0.1:{local_port}", flush=True)
    while transport.is_active():
        try:
            connection, peer = listener.accept()
        except TimeoutError:
            continue
        try:
            _splice(transport.open_channel("direct-tcpip", ("127.0.0.1", local_port), peer), connection)
        except paramiko.SSHException as exc:
            print(f"the device refused a connection to its server port: {exc}", flush=True)
            connection.close()
    print("the SSH connection closed; the tunnel ends", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
