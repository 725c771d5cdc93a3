"""`edgetune fleet up` and `down`: start, and later stop, everything a recipe's targets are measured on.

`up` starts the recipe's tracker (when it asks for one), then, for each `ssh` target, logs into the
device, checks it (architecture, Python, TVM of this machine's version), and starts the device's
RPC server detached, with a pid file and a log under the target's `workdir` on the device. A device
that cannot reach the tracker gets an SSH tunnel (edgetune.fleet.tunnel). `up` is done with a
target once the tracker lists its new server. `down` stops exactly those processes, found by their
pid files, and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import paramiko

from edgetune.errors import BuildError
from edgetune.fleet import ssh, tracker, tunnel
from edgetune.fleet.endpoints import fleet_dir, tracker_address
from edgetune.isolated import TORCH_REFUSED, TORCH_REFUSED_DIR
from edgetune.ownership import mark_owned
from edgetune.profiles import resolve_profile
from edgetune.recipe import FleetTarget, Recipe, SshSpec
from edgetune.toolchains import device_arch

SERVER_MODULE = "tvm.exec.rpc_server"
_REGISTER_TIMEOUT_S = 60.0

# Runs on the device with its own Python (which need not have edgetune): manages the server process.
_PROCESS_SCRIPT = r"""
import json, os, signal, subprocess, sys, time
arg = json.loads(sys.argv[1])
pid_file = os.path.join(arg["dir"], arg["name"] + ".pid")
log_file = os.path.join(arg["dir"], arg["name"] + ".log")

def running():
    try:
        pid = int(open(pid_file).read())
        command = open("/proc/%d/cmdline" % pid, "rb").read().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return None
    return pid if all(m in command for m in arg["markers"]) else None

def tail():
    try:
        return "\n".join(open(log_file, errors="replace").read().splitlines()[-5:])
    except OSError:
        return ""

pid = running()
if arg["op"] == "start" and pid is None:
    refusing = os.path.join(arg["dir"], arg["torch_refused_dir"])
    os.makedirs(os.path.join(refusing, "torch"), exist_ok=True)
    with open(os.path.join(refusing, "torch", "__init__.py"), "w") as init:
        init.write(arg["torch_refused"])
    env = dict(os.environ, **arg["env"])
    env["PYTHONPATH"] = os.pathsep.join([refusing] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with open(log_file, "ab") as log:
        pid = subprocess.Popen(arg["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, cwd=arg["dir"], env=env).pid
    open(pid_file, "w").write("%d\n" % pid)
    print(json.dumps({"pid": pid, "started": True}))
elif arg["op"] == "stop":
    if pid is not None:
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                break
            deadline = time.time() + 10
            while running() is not None and time.time() < deadline:
                time.sleep(0.1)
            if running() is None:
                break
    if os.path.exists(pid_file):
        os.remove(pid_file)
    print(json.dumps({"pid": pid}))
else:
    print(json.dumps({"pid": pid, "started": False, "log": tail()}))
"""

# Runs on the device: its Python's and TVM's versions (TVM imported without PyTorch, which it would import: 2 s)
_VERSIONS_SCRIPT = r"""
import platform, sys
sys.modules.setdefault("torch", None)
import tvm
print(platform.python_version(), tvm.__version__)
"""

# Runs on the device: can it reach the tracker, and from which of its addresses?
_PROBE_SCRIPT = r"""
import json, socket, struct, sys
arg = json.loads(sys.argv[1])
try:
    with socket.create_connection((arg["host"], arg["port"]), timeout=3) as sock:
        sock.sendall(struct.pack("<i", arg["magic"]))
        reply = sock.recv(4)
        ok = len(reply) == 4 and struct.unpack("<i", reply)[0] == arg["magic"]
        print(json.dumps({"reachable": ok, "address": sock.getsockname()[0]}))
except OSError:
    print(json.dumps({"reachable": False, "address": None}))
"""

_ARCH_NAMES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64",
               "armv7l": "armv7", "armv7": "armv7", "armv8l": "armv7"}

Report = Callable[[str, str], None]
"""(who, what happened): 'tracker' or a target name, and one line."""


@dataclass(frozen=True)
class DeviceInfo:
    arch: str
    python: str
    tvm: str


def _markers(spec: SshSpec) -> list[str]:
    return [SERVER_MODULE, f"--key {spec.key}"]


def _process(client: paramiko.SSHClient, spec: SshSpec, op: str, argv: list[str] | None = None,
             env: dict[str, str] | None = None) -> dict:
    """Start, stop or look at the device's server process through its pid file."""
    argument = {"op": op, "dir": spec.workdir, "name": spec.key, "markers": _markers(spec), "argv": argv,
                "env": env or {}, "torch_refused_dir": TORCH_REFUSED_DIR, "torch_refused": TORCH_REFUSED}
    code, out, err = ssh.run_python(client, spec.python, _PROCESS_SCRIPT, argument)
    if code != 0:
        raise BuildError(f"{spec.host}: managing the RPC server failed: {(err or out).strip()[-400:]}")
    return json.loads(out)


def server_status(client: paramiko.SSHClient, spec: SshSpec) -> dict:
    """{"pid": pid or None, "log": the server log's last lines} on the device."""
    return _process(client, spec, "status")


def check_device(target: str, client: paramiko.SSHClient, spec: SshSpec, arch: str) -> DeviceInfo:
    """The device must be the profile's architecture and run TVM of this machine's version."""
    import tvm

    code, out, err = ssh.run(client, "uname -m")
    found = _ARCH_NAMES.get(out.strip(), out.strip())
    if code != 0 or found != arch:
        raise BuildError(f"target '{target}': {spec.host} is {found or err.strip()!r}, but its profile builds "
                         f"for {arch}")
    code, out, err = ssh.run_python(client, spec.python, _VERSIONS_SCRIPT)
    if code != 0:
        raise BuildError(f"target '{target}': {spec.python} on {spec.host} cannot import tvm "
                         f"({(err or out).strip()[-300:]}); install it there: {spec.python} -m pip install "
                         f"apache-tvm=={tvm.__version__}")
    python_version, tvm_version = out.split()
    if tvm_version != tvm.__version__:
        raise BuildError(f"target '{target}': {spec.host} has TVM {tvm_version}, this machine {tvm.__version__}; "
                         f"RPC needs the same version: {spec.python} -m pip install apache-tvm=={tvm.__version__}")
    return DeviceInfo(found, python_version, tvm_version)


def _probe(client: paramiko.SSHClient, spec: SshSpec, address: str) -> str | None:
    """The device's address that reaches the tracker directly, or None when it cannot."""
    from tvm.rpc import base

    host, _, port = address.rpartition(":")
    code, out, _ = ssh.run_python(client, spec.python, _PROBE_SCRIPT,
                                  {"host": host, "port": int(port), "magic": base.RPC_TRACKER_MAGIC})
    answer = json.loads(out) if code == 0 else {"reachable": False}
    return answer["address"] if answer["reachable"] else None


def provision(recipe: Recipe, target: FleetTarget, report: Report) -> None:
    """Check the target's device and start its RPC server, registered with the tracker."""
    assert target.connection is not None and target.connection.ssh is not None
    spec = target.connection.ssh
    address = tracker_address(recipe, target)
    assert address is not None
    profile = resolve_profile(target.profile, target.overrides)
    arch = device_arch(profile)
    directory = fleet_dir(recipe)
    with ssh.connect(target.name, spec, recipe.base_dir) as client:
        info = check_device(target.name, client, spec, arch)
        report(target.name, f"{spec.host}: {info.arch}, Python {info.python}, TVM {info.tvm}")
        running = server_status(client, spec)["pid"]
        before = tracker.query(address).key(spec.key).total
        if running is not None and before > 0:
            report(target.name, f"RPC server already running on the device (pid {running})")
            return
        if running is not None:  # e.g. its tunnel ended: it cannot reach the tracker any more
            report(target.name, f"restarting the device's RPC server (pid {running}): the tracker lists none "
                                f"under key '{spec.key}'")
            _process(client, spec, "stop")
            tunnel.stop(directory, target.name)
        argv = [spec.python, "-m", SERVER_MODULE, "--key", spec.key]
        reached_from = _probe(client, spec, address)
        if reached_from is not None:
            argv += ["--tracker", address, "--host", reached_from]
            route = f"reaching the tracker directly from {reached_from}"
            exposed = tracker.exposure_warning(f"RPC server on {spec.host}", reached_from)
            if exposed:
                report(target.name, exposed)
        else:
            link = tunnel.start(target.name, spec, recipe.base_dir, address, directory)
            argv += ["--tracker", f"127.0.0.1:{link.remote_port}", "--host", "127.0.0.1",
                     "--port", str(link.local_port), "--port-end", str(link.local_port + 1),
                     "--custom-addr", "127.0.0.1"]
            route = f"through an SSH tunnel (helper pid {link.pid})"
        # Kernels run on the profile's cores, as tuned for (left alone, TVM on x86 runs half the CPUs)
        env = {"TVM_NUM_THREADS": str(profile.cpu_threads)} if profile.cpu_threads else {}
        pid = _process(client, spec, "start", argv, env)["pid"]
        if not tracker.wait_for_servers(address, spec.key, before + 1, _REGISTER_TIMEOUT_S):
            log = server_status(client, spec).get("log", "")
            _process(client, spec, "stop")
            tunnel.stop(directory, target.name)
            raise BuildError(f"target '{target.name}': the RPC server started on {spec.host} (pid {pid}) but did "
                             f"not register with the tracker {address} under key '{spec.key}' within "
                             f"{_REGISTER_TIMEOUT_S:.0f} s; its log ({spec.workdir}/{spec.key}.log) ends with:\n{log}")
        report(target.name, f"RPC server started on the device (pid {pid}, log {spec.workdir}/{spec.key}.log), "
                            f"{route}; registered under key '{spec.key}' at {address}")


def unprovision(recipe: Recipe, target: FleetTarget, report: Report) -> None:
    """Stop the target's RPC server (by its pid file on the device) and its tunnel, if any."""
    assert target.connection is not None and target.connection.ssh is not None
    spec = target.connection.ssh
    try:
        with ssh.connect(target.name, spec, recipe.base_dir) as client:
            pid = _process(client, spec, "stop")["pid"]
        report(target.name, f"RPC server stopped on the device (pid {pid})" if pid
               else "no RPC server of ours was running on the device")
    finally:
        helper = tunnel.stop(fleet_dir(recipe), target.name)
        if helper:
            report(target.name, f"SSH tunnel stopped (helper pid {helper})")


def up(recipe: Recipe, report: Report) -> list[str]:
    """Start the recipe's tracker and every ssh target's server; the problems, one per failed part."""
    problems = []
    mark_owned(recipe.output_dir / recipe.name)  # its pid files go there: the build that follows may write there too
    if not (recipe.tracker and recipe.tracker.start) and all(t.connection is None for t in recipe.fleet):
        report("fleet", "nothing to start: the recipe runs no tracker and has no remote targets")
    if recipe.tracker is not None and recipe.tracker.start:
        try:
            pid, started = tracker.start(recipe.tracker, fleet_dir(recipe))
            log = tracker.log_file(fleet_dir(recipe))
            report("tracker", f"{'started' if started else 'already running'} on {recipe.tracker.host}:"
                              f"{recipe.tracker.port} (pid {pid}, log {log})")
            exposed = tracker.exposure_warning("RPC tracker", recipe.tracker.host)
            if exposed:
                report("tracker", exposed)
        except BuildError as exc:
            return [str(exc)]
    for target in recipe.fleet:
        connection = target.connection
        try:
            if connection is not None and connection.ssh is not None:
                provision(recipe, target, report)
            elif connection is not None and connection.rpc is not None:
                total = tracker.query(connection.rpc.tracker).key(connection.rpc.key).total
                report(target.name, f"{total} server(s) registered under key '{connection.rpc.key}' at "
                                    f"{connection.rpc.tracker} (rpc connections are started by their owners)")
        except BuildError as exc:
            problems.append(str(exc))
    return problems


def down(recipe: Recipe, report: Report) -> list[str]:
    """Stop what `up` started for the recipe, servers first, then tunnels, then the tracker."""
    problems = []
    for target in recipe.fleet:
        if target.connection is not None and target.connection.ssh is not None:
            try:
                unprovision(recipe, target, report)
            except BuildError as exc:
                problems.append(str(exc))
    pid = tracker.stop(fleet_dir(recipe))
    if pid is not None:
        report("tracker", f"stopped (pid {pid})")
    elif recipe.tracker is not None and recipe.tracker.start:
        report("tracker", "none of ours was running")
    return problems
