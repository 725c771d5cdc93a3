"""The fleet with real processes on 127.0.0.1: RPC trackers, RPC servers, and an sshd standing in for a board.

The "devices" are this machine: RPC servers started directly, or provisioned by `edgetune fleet up`
through a real OpenSSH server (Debian's openssh-server) that logs in with a generated key. A second
sshd runs in a network namespace of its own, so its "device" cannot reach this machine's tracker and
`fleet up` has to tunnel. Tuning is tiny (tiny_cnn, 4 trials per task).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import run_edgetune as edgetune

from edgetune.errors import BuildError, InputError
from edgetune.fleet import tracker
from edgetune.fleet.endpoints import RemoteDevice, override_connection, remote_device
from edgetune.isolated import TORCH_REFUSED_DIR, environment_without_torch
from edgetune.recipe import load_recipe, load_recipe_text

SSHD = "/usr/sbin/sshd"
INSTALL = "apt-get install -y --no-install-recommends openssh-server openssh-client iproute2 (.ci/run installs them)"
KEY = "host-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """A process in a session of its own, so the test can stop it with all its children; started as `fleet up`
    starts a tracker or a server, without PyTorch (edgetune.isolated: 3 s instead of 7 for each to come up)."""
    environment = environment_without_torch(log.parent / TORCH_REFUSED_DIR, os.environ)
    with log.open("ab") as stream:
        return subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True,
                                env=environment)


def kill(process: subprocess.Popen, signum: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
    if signum == signal.SIGKILL:
        process.wait(timeout=30)


def start_tracker(directory: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = start([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                     "--port-end", str(port + 1)], directory / "tracker.log")
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            tracker.query(address, timeout_s=1)
            return process, address
        except BuildError:
            time.sleep(0.2)
    raise AssertionError(f"the tracker did not start: {(directory / 'tracker.log').read_text()}")


def start_server(directory: Path, address: str, key: str = KEY) -> subprocess.Popen:
    port = free_port()
    return start([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", address, "--key", key,
                  "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                 directory / f"server-{port}.log")


def loaded_pytorch(pid: int) -> bool:
    """Whether the process or any of its children mapped PyTorch's library."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return any("libtorch" in Path(f"/proc/{process.pid}/maps").read_text() for process in processes)


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# --- recipes and flags (no device needed) ---------------------------------------------------------

FLEET_RECIPE = """\
name: fleet
model: {{zoo: tiny_cnn}}
{tracker}fleet:
  - name: board
    profile: host
    connection:
      ssh:
        host: 127.0.0.1
        port: {ssh_port}
        user: {user}
        key_file: {key_file}
        known_hosts: {known_hosts}
        accept_new_host_key: {accept_new}
        python: {python}
        workdir: {workdir}
        key: {key}
        timeout_s: 10
tuning: {{trials_per_task: 4, max_tasks: {max_tasks}, seed: 1}}
output: out
"""


def test_ssh_connections_validate_and_refuse_passwords(tmp_path: Path) -> None:
    text = FLEET_RECIPE.format(tracker="tracker: {port: 9299}\n", ssh_port=2222, user="pi", key_file="id",
                               known_hosts="kh", accept_new="false", python="python3", workdir="w", key="rpi",
                               max_tasks=1)
    recipe = load_recipe_text(text, base_dir=tmp_path)
    assert recipe.tracker is not None and (recipe.tracker.host, recipe.tracker.start) == ("127.0.0.1", True)
    remote = remote_device(recipe, recipe.fleet[0], "cpu", Path("/usr/bin/gcc"))
    assert remote == RemoteDevice("127.0.0.1", 9299, "rpi", 10.0, "/usr/bin/gcc", "cpu")
    assert remote.where == "rpc key rpi via 127.0.0.1:9299"

    (tmp_path / "bad.yaml").write_text(text.replace("tracker: {port: 9299}\n", "").replace(
        "        key: rpi\n", "        key: rpi\n        password: hunter2\n"))
    run = edgetune("validate", "bad.yaml", cwd=tmp_path)
    assert run.returncode == 2
    assert "bad.yaml:7: fleet[0].connection.ssh: a password cannot be given in a recipe" in run.stderr
    assert "fleet[0].connection.ssh.tracker: no tracker" in run.stderr


def test_rpc_flags_replace_one_targets_connection(tmp_path: Path) -> None:
    text = FLEET_RECIPE.format(tracker="tracker: {port: 9299}\n", ssh_port=2222, user="pi", key_file="id",
                               known_hosts="kh", accept_new="false", python="python3", workdir="w", key="rpi",
                               max_tasks=1)
    recipe = load_recipe_text(text, base_dir=tmp_path)
    replaced = override_connection(recipe, None, "10.0.0.5:9190", "pi4")
    assert replaced.fleet[0].connection.rpc.tracker == "10.0.0.5:9190" and replaced.fleet[0].connection.key == "pi4"
    assert replaced.fleet[0].connection.rpc.timeout_s == 10.0 and replaced.base_dir == recipe.base_dir
    with pytest.raises(InputError, match="--rpc-tracker: expected 'host:port'"):
        override_connection(recipe, None, "nohost", "pi4")
    with pytest.raises(InputError, match="go together"):
        override_connection(recipe, None, "10.0.0.5:9190", None)
    two = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "fleet.yaml")
    with pytest.raises(InputError, match="choose it with --target"):
        override_connection(two, None, "10.0.0.5:9190", "pi4")
    assert override_connection(two, ["orin"], "10.0.0.5:9190", "pi4").fleet[3].connection.key == "pi4"


# --- the runner: a hung server, a lost key --------------------------------------------------------

@pytest.fixture()
def tracker_with_two_servers(tmp_path: Path):
    process, address = start_tracker(tmp_path)
    servers = [start_server(tmp_path, address), start_server(tmp_path, address)]
    try:
        assert tracker.wait_for_servers(address, KEY, 2, 90), "the RPC servers did not register"
        yield address, servers
    finally:
        for server in servers:
            kill(server)
        kill(process)


@pytest.mark.slow
def test_runner_retries_a_hung_server_elsewhere_and_names_a_lost_key(tracker_with_two_servers, tmp_path) -> None:
    import tvm
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.runner import RunnerInput
    from tvm.script import tirx as T

    from edgetune.tuning.builder import export_shared_object
    from edgetune.tuning.remote import RetryingRPCRunner

    @T.prim_func
    def add_one(a: T.Buffer((1024,), "float32"), b: T.Buffer((1024,), "float32")):
        for i in range(1024):
            b[i] = a[i] + T.float32(1)

    address, servers = tracker_with_two_servers
    module = tvm.compile(tvm.IRModule({"main": add_one}), target="llvm")
    inputs = [RunnerInput(export_shared_object("gcc", str(tmp_path), module), "cpu",
                          ArgInfo.from_prim_func(add_one)) for _ in range(4)]
    host, _, port = address.rpartition(":")
    stop = threading.Event()
    runner = RetryingRPCRunner(RemoteDevice(host, int(port), KEY, 2.0, "gcc"), stop)

    kill(servers[0], signal.SIGSTOP)  # hangs: the tracker still hands it out once
    started = time.monotonic()
    results = [future.result() for future in runner.run(inputs)]
    assert [r.error_msg for r in results] == [None] * 4  # the hung server's candidate ran on the other one
    assert all(r.run_secs and float(r.run_secs[0]) > 0 for r in results)
    assert time.monotonic() - started >= 2.0  # it cost one timeout
    assert not stop.is_set() and runner.lost is None

    # both servers hang, then die mid-measurement: the tracker stops listing them and the runner cuts its
    # sessions then, not after their 60-s timeout (a board killed mid-tune cost a build 40 s)
    kill(servers[1], signal.SIGSTOP)
    patient_stop = threading.Event()
    patient = RetryingRPCRunner(RemoteDevice(host, int(port), KEY, 60.0, "gcc"), patient_stop)
    measured: list = []
    measuring = threading.Thread(target=lambda: measured.extend(f.result() for f in patient.run(inputs[:2])))
    started = time.monotonic()
    measuring.start()
    time.sleep(1.0)
    for server in servers:
        kill(server)
    measuring.join(timeout=120)
    assert time.monotonic() - started < 20, time.monotonic() - started
    assert len(measured) == 2 and all(r.error_msg and "the tracker lists no server" in r.error_msg for r in measured)
    assert patient_stop.is_set() and "(the tracker lists none)" in patient.lost
    patient.close()

    deadline = time.monotonic() + 30
    while tracker.query(address).key(KEY).total and time.monotonic() < deadline:  # the tracker sees them go
        time.sleep(0.1)
    lost = f"no RPC server left under key '{KEY}' at the tracker {address} (the tracker lists none)"
    with pytest.raises(RuntimeError, match=re.escape(lost)):  # DeviceLost, as it comes back through TVM's FFI
        runner.run(inputs)
    assert stop.is_set() and runner.lost == lost
    assert not any(Path(i.artifact_path).exists() for i in inputs)  # nothing left behind for MetaSchedule to clean

    (tmp_path / "tiny.yaml").write_text("name: tiny\nmodel: {zoo: tiny_cnn}\nfleet: [{name: board, profile: host}]\n"
                                        "tuning: {trials_per_task: 4, max_tasks: 1}\noutput: out\n")
    run = edgetune("build", "tiny.yaml", "--rpc-tracker", address, "--rpc-key", KEY, cwd=tmp_path)
    assert run.returncode == 1
    assert f"no RPC server is registered under key '{KEY}' at the tracker {address}" in " ".join(run.stdout.split())


@pytest.mark.slow
def test_tuning_stops_naming_a_lost_key_keeps_its_records_and_resumes(tracker_with_two_servers, tmp_path) -> None:
    from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.database.store import RecordStore
    from edgetune.tuning.remote import DeviceLost
    from edgetune.tuning.tasks import extract_tasks
    from edgetune.tuning.tune import TuningPlan, tune

    address, servers = tracker_with_two_servers
    target = resolve_profile("host", None).tvm_target()
    model = to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None))
    tasks = extract_tasks(fuse_for_tuning(model, target), target)[-2:]  # the lightest: quick to search
    host, _, port = address.rpartition(":")
    plan = TuningPlan(trials_per_task=1, time_budget_s=None, search="evolutionary", seed=1, cores=2,
                      remote=RemoteDevice(host, int(port), KEY, 10.0, "gcc"))
    store = RecordStore(tmp_path / "records")
    saved = tmp_path / "records" / "database_tuning_record.json"

    def lose_every_server(progress) -> None:  # called once the first task's batch is committed
        for server in servers:
            kill(server)
        while tracker.query(address).key(KEY).total:
            time.sleep(0.1)

    with pytest.raises(DeviceLost, match=f"no RPC server left under key '{KEY}' at the tracker {address}"):
        tune(tasks, target, store, plan, lose_every_server)
    kept = saved.read_text().splitlines()
    assert len(kept) == 1  # the first task's measurement; the second's batch found no server: not recorded

    servers.append(start_server(tmp_path, address))
    assert tracker.wait_for_servers(address, KEY, 1, 90)
    resumed = tune(tasks, target, store, plan)
    assert [t.trials_measured for t in resumed.tasks] == [0, 1]
    assert saved.read_text().splitlines()[:1] == kept


# --- sshd standing in for a board -----------------------------------------------------------------

@dataclass(frozen=True)
class Sshd:
    port: int
    directory: Path
    key_file: Path
    known_hosts_line: str
    """The sshd's host key as a known_hosts line for 127.0.0.1:port."""


def _require_tools(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None and not Path(tool).is_file()]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: {INSTALL}")


def _run_sshd(directory: Path, prefix: list[str]) -> tuple[subprocess.Popen, int]:
    """A real OpenSSH server on 127.0.0.1 with generated host and user keys; key logins only."""
    _require_tools(SSHD, "ssh-keygen")
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        if not (directory / name).exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True)
    shutil.copy(directory / "user_key.pub", directory / "authorized_keys")
    (directory / "sshd_config").write_text(
        f"HostKey {directory / 'host_key'}\nAuthorizedKeysFile {directory / 'authorized_keys'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"PermitRootLogin prohibit-password\nAllowTcpForwarding yes\nPidFile {directory / 'sshd.pid'}\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    port = free_port()
    sshd = start(prefix + [SSHD, "-D", "-e", "-f", str(directory / "sshd_config"), "-p", str(port),
                           "-o", "ListenAddress=127.0.0.1"], directory / "sshd.log")
    deadline = time.monotonic() + 20
    while "Server listening" not in (directory / "sshd.log").read_text():
        assert sshd.poll() is None and time.monotonic() < deadline, (directory / "sshd.log").read_text()
        time.sleep(0.1)
    return sshd, port


def _known_hosts_line(directory: Path, port: int) -> str:
    kind, key = (directory / "host_key.pub").read_text().split()[:2]
    return f"[127.0.0.1]:{port} {kind} {key}\n"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> Sshd:
    directory = tmp_path_factory.mktemp("sshd")
    process, port = _run_sshd(directory, [])
    try:
        yield Sshd(port, directory, directory / "user_key", _known_hosts_line(directory, port))
    finally:
        kill(process, signal.SIGTERM)
        process.wait(timeout=30)


def write_fleet_recipe(directory: Path, server: Sshd, tracker_port: int | None, *, known_hosts: str,
                       accept_new: bool = False, max_tasks: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "known_hosts").write_text(known_hosts)
    section = f"tracker: {{host: 127.0.0.1, port: {tracker_port}, start: true}}\n" if tracker_port else ""
    text = FLEET_RECIPE.format(
        tracker=section, ssh_port=server.port, user=os.environ.get("USER") or __import__("getpass").getuser(),
        key_file=server.key_file, known_hosts="known_hosts", accept_new=str(accept_new).lower(),
        python=sys.executable, workdir=directory / "device", key=KEY, max_tasks=max_tasks,
    )
    if not tracker_port:
        text = text.replace(f"        key: {KEY}\n", f"        key: {KEY}\n        tracker: 127.0.0.1:{free_port()}\n")
    (directory / "fleet.yaml").write_text(text)
    return directory / "fleet.yaml"


def records(directory: Path) -> list[str]:
    paths = sorted((directory / "out" / "fleet" / "records").glob("board-*/database_tuning_record.json"))
    return paths[0].read_text().splitlines() if paths else []


@pytest.mark.slow
def test_fleet_up_build_through_a_killed_server_status_and_down(sshd: Sshd, tmp_path: Path) -> None:
    """fleet up provisions a server over SSH; a second server under the key is killed mid-tune."""
    tracker_port = free_port()
    address = f"127.0.0.1:{tracker_port}"
    write_fleet_recipe(tmp_path, sshd, tracker_port, known_hosts=sshd.known_hosts_line, max_tasks=2)
    up = edgetune("fleet", "up", "fleet.yaml", cwd=tmp_path)
    extra = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"registered under key '{KEY}' at {address}" in up.stdout
        assert "reaching the tracker directly" in up.stdout
        device_pid = int((tmp_path / "device" / f"{KEY}.pid").read_text())
        assert pid_alive(device_pid)
        tracker_pid = int((tmp_path / "out" / "fleet" / "fleet" / "tracker.pid").read_text())
        for pid in (device_pid, tracker_pid):  # each, and the TVM pool worker it started, without PyTorch
            assert not loaded_pytorch(pid) and len(psutil.Process(pid).children(recursive=True)) >= 1

        extra = start_server(tmp_path, address)
        assert tracker.wait_for_servers(address, KEY, 2, 90)
        started = time.monotonic()
        build = subprocess.Popen([sys.executable, "-m", "edgetune", "build", "fleet.yaml", "--json", "summary.json"],
                                 cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while not records(tmp_path) and build.poll() is None and time.monotonic() - started < 400:
            time.sleep(0.2)
        before = records(tmp_path)
        kill(extra)  # the first batch is in; the second task is measured on what remains
        output, _ = build.communicate(timeout=600)
        assert before, output
        assert build.returncode == 0, output
        after = records(tmp_path)
        assert after[: len(before)] == before and len(after) > len(before)

        board = json.loads((tmp_path / "summary.json").read_text())["targets"]["board"]
        assert board["verified"] is True and board["latency_ms"] > 0 and board["untuned_latency_ms"] > 0
        assert board["reference_latency_ms"] is None  # ONNX Runtime does not run on the device
        manifest = json.loads((tmp_path / "out" / "fleet" / "board" / "manifest.json").read_text())
        assert manifest["measured_on"] == f"rpc key {KEY} via {address}"
        assert f"TVM's runtime on the device, rpc key {KEY} via {address}" in manifest["verification"]["methods"]

        status = edgetune("fleet", "status", "fleet.yaml", cwd=tmp_path)
        assert status.returncode == 0, status.stdout + status.stderr
        assert tracker.query(address).key(KEY).total == 1
        assert f"1 server(s) under key '{KEY}'; 127.0.0.1: RPC server running (pid {device_pid})" in status.stdout
    finally:
        if extra is not None:
            kill(extra)
        down = edgetune("fleet", "down", "fleet.yaml", cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"RPC server stopped on the device (pid {device_pid})" in down.stdout
    assert not pid_alive(device_pid)
    assert "[tracker] stopped" in down.stdout and not (tmp_path / "out" / "fleet" / "fleet" / "tracker.pid").exists()


@pytest.mark.slow
def test_unknown_host_key_is_refused_unless_accept_new(sshd: Sshd, tmp_path: Path) -> None:
    write_fleet_recipe(tmp_path, sshd, None, known_hosts="")
    refused = edgetune("fleet", "up", "fleet.yaml", cwd=tmp_path)
    assert refused.returncode == 1
    message = " ".join(refused.stderr.replace("error:", "").split())
    assert f"the SSH host key of [127.0.0.1]:{sshd.port}" in message and "is not in" in message
    assert "accept_new_host_key: true" in message
    assert (tmp_path / "known_hosts").read_text() == ""

    write_fleet_recipe(tmp_path, sshd, None, known_hosts="", accept_new=True)
    accepted = edgetune("fleet", "status", "fleet.yaml", cwd=tmp_path)  # logs in; no tracker runs, so exit 1
    assert "no RPC server running" in accepted.stdout, accepted.stdout + accepted.stderr
    assert (tmp_path / "known_hosts").read_text().split() == sshd.known_hosts_line.split()

    changed = sshd.known_hosts_line.rsplit(" ", 1)[0] + " " + (sshd.directory / "user_key.pub").read_text().split()[1]
    write_fleet_recipe(tmp_path, sshd, None, known_hosts=changed + "\n", accept_new=True)
    refused = edgetune("fleet", "status", "fleet.yaml", cwd=tmp_path)
    assert "CHANGED" in refused.stdout and refused.returncode == 1


@pytest.mark.slow
def test_device_that_cannot_reach_the_tracker_is_tunnelled(tmp_path: Path) -> None:
    """An sshd in its own network namespace: its loopback is not this machine's, so fleet up tunnels."""
    _require_tools("unshare", "ip")
    if os.geteuid() != 0:
        pytest.fail("this test needs root: it runs sshd in a network namespace of its own (unshare -n)")
    directory = tmp_path / "sshd"
    netns_sshd, inner_port = _run_sshd(directory, ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "-"])
    namespace_pid = int((directory / "sshd.pid").read_text())
    bridge_port = free_port()  # this machine's 127.0.0.1:bridge_port -> the namespace's 127.0.0.1:inner_port
    bridge = start([sys.executable, "-c", BRIDGE, str(bridge_port), str(namespace_pid), str(inner_port)],
                   tmp_path / "bridge.log")
    server = Sshd(bridge_port, directory, directory / "user_key", _known_hosts_line(directory, bridge_port))
    tracker_port = free_port()
    write_fleet_recipe(tmp_path, server, tracker_port, known_hosts=server.known_hosts_line)
    try:
        deadline = time.monotonic() + 20
        while "ready" not in (tmp_path / "bridge.log").read_text():
            assert time.monotonic() < deadline and bridge.poll() is None, (tmp_path / "bridge.log").read_text()
            time.sleep(0.1)
        up = edgetune("fleet", "up", "fleet.yaml", cwd=tmp_path)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "through an SSH tunnel" in up.stdout
        helper_pid = int((tmp_path / "out" / "fleet" / "fleet" / "tunnel-board.pid").read_text())

        from edgetune.compile import compile_model, export_library
        from edgetune.fleet.session import remote_outputs
        from edgetune.frontend.onnx import load_model, to_relax
        from edgetune.profiles import resolve_profile

        model = load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None)
        library = export_library(compile_model(to_relax(model), resolve_profile("host", None).tvm_target(), None),
                                 tmp_path / "model.so")
        sample = model.sample_inputs()
        remote = RemoteDevice("127.0.0.1", tracker_port, KEY, 10.0, "gcc")
        outputs = remote_outputs(remote, library, [sample[i.name] for i in model.inputs])
        assert outputs[0].shape == (1, 10)
    finally:
        down = edgetune("fleet", "down", "fleet.yaml", cwd=tmp_path)
        kill(bridge)
        kill(netns_sshd, signal.SIGTERM)
        netns_sshd.wait(timeout=30)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"SSH tunnel stopped (helper pid {helper_pid})" in down.stdout and not pid_alive(helper_pid)


BRIDGE = r"""
import ctypes, os, socket, sys, threading
port, namespace_pid, inner_port = map(int, sys.argv[1:4])
listener = socket.create_server(("127.0.0.1", port))  # in this machine's namespace
if ctypes.CDLL(None, use_errno=True).setns(os.open(f"/proc/{namespace_pid}/ns/net", os.O_RDONLY), 0x40000000):
    raise OSError(ctypes.get_errno(), "setns")  # sockets made from here on live in the sshd's namespace

def copy(source, sink):
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        source.close()
        sink.close()

print("ready", flush=True)
while True:
    outer, _ = listener.accept()
    inner = socket.create_connection(("127.0.0.1", inner_port))
    threading.Thread(target=copy, args=(outer, inner), daemon=True).start()
    threading.Thread(target=copy, args=(inner, outer), daemon=True).start()
"""


@pytest.mark.slow
def test_verify_runs_an_artifact_on_a_device_over_rpc(tracker_with_two_servers, tmp_path: Path) -> None:
    address, _ = tracker_with_two_servers
    (tmp_path / "r.yaml").write_text("name: r\nmodel: {zoo: tiny_cnn}\nfleet: [{name: host, profile: host}]\n"
                                     "tuning: {trials_per_task: 0}\noutput: out\n")
    built = subprocess.run([sys.executable, "-m", "edgetune", "build", "r.yaml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    archive = str(tmp_path / "out" / "r" / "host.tar.gz")
    verify = subprocess.run([sys.executable, "-m", "edgetune", "verify", archive, "--rpc-tracker", address,
                             "--rpc-key", KEY], capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "OK" in verify.stdout
    half = subprocess.run([sys.executable, "-m", "edgetune", "verify", archive, "--rpc-tracker", address],
                          capture_output=True, text=True, timeout=120)
    assert half.returncode == 2 and "--rpc-key" in half.stderr
