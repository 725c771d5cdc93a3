"""Emulated aarch64 boards: a real arm64 Debian userland and TVM's own RPC server, run under qemu-aarch64.

A board is what a real one runs (Debian's python3.11, the aarch64 apache-tvm/apache-tvm-ffi/numpy
wheels from PyPI, `python3 -m tvm.exec.rpc_server --tracker ... --key ...`), executed by qemu's user
mode without binfmt registration: the interpreter is started through `qemu-aarch64` directly. The
server's worker processes are started through a launcher script (a host shell script, named as
`sys.executable` by a `sitecustomize` in the board's site directory) that goes back through qemu.

The root file system is built once (mmdebstrap extracts Debian's arm64 packages, pip installs the
wheels with `--platform`), kept under `$EDGETUNE_CACHE/boards/` and checksummed: a changed or
half-built tree is never used. Timings measured on such a board are qemu's, not the device's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from edgetune.errors import BuildError, InputError
from edgetune.fleet import processes, tracker
from edgetune.ownership import cache_dir, is_owned, mark_owned
from edgetune.profiles import load_profile, profile_names, unknown_profile_message
from edgetune.recipe import TrackerSpec

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libgcc-s1", "zlib1g")
"""The interpreter and what TVM's and numpy's aarch64 libraries link against; nothing else."""
BOARD_WHEELS = ("apache-tvm", "apache-tvm-ffi", "numpy", "ml_dtypes", "tornado", "psutil", "cloudpickle")
"""Installed on the board at this machine's versions: the RPC protocol and the runtime must match."""
WHEEL_PLATFORMS = ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_17_aarch64",
                   "manylinux2014_aarch64")
"""pip does not widen a `--platform`: each manylinux level a wheel may carry is named (bookworm has glibc 2.36)."""
BOARD_PYTHON = "usr/bin/python3.11"
SITE_DIR = "opt/edgetune/site"
LAUNCHER = "opt/edgetune/python"
CHECKSUM_NAME = "rootfs.sha256"
_MARKER = "tvm.exec.rpc_server"
_SERVER_PORTS = range(9300, 9500)
"""Where boards' RPC servers listen. TVM's server binds with SO_REUSEADDR and listens only after its scan:
two boards scanning the same ports side by side can both bind one and the second fails in listen(), so each
board of one `fleet up` scans a block of its own (`port_block`)."""
_START_TIMEOUT_S = 240.0
"""Until the board's server registers: qemu starts python and imports TVM's 230 MB compiler library twice."""

_LAUNCHER_TEXT = '#!/bin/sh\n# The board python, for processes the board starts: back through qemu-aarch64.\n' \
                 'exec qemu-aarch64 "$EDGETUNE_BOARD_PYTHON" "$@"\n'
_SITECUSTOMIZE_TEXT = ('"""On an emulated board, processes started with sys.executable go through qemu (edgetune)."""\n'
                       "import os\nimport sys\n\n"
                       'if os.environ.get("EDGETUNE_BOARD_LAUNCHER"):\n'
                       '    sys.executable = os.environ["EDGETUNE_BOARD_LAUNCHER"]\n')


@dataclass(frozen=True)
class Board:
    """One emulated board as `fleet up --emulate` recorded it."""

    key: str
    profile: str
    arch: str
    qemu_cpu: str
    cores: int
    tracker: str
    rootfs: str
    pid: int | None = None
    """Set when read back: the board's server process, if it still runs."""


def board_versions() -> dict[str, str]:
    """The wheel versions boards get: this machine's own."""
    try:
        return {name: metadata.version(name) for name in BOARD_WHEELS}
    except metadata.PackageNotFoundError as exc:
        raise BuildError(f"{exc.name} is not installed here; boards get this machine's versions of "
                         f"{', '.join(BOARD_WHEELS)}") from None


def rootfs_dir() -> Path:
    """Where the root file system for these versions lives (one per Debian suite, package and wheel set)."""
    spec = json.dumps([SUITE, DEBIAN_PACKAGES, board_versions(), sys.version_info[:2]], sort_keys=True)
    return cache_dir() / "boards" / f"aarch64-{SUITE}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path and content (a link's target) in `root`, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root)).encode()
        if path.is_symlink():
            digest.update(b"L" + relative + b"\0" + os.readlink(path).encode() + b"\0")
        elif path.is_file():
            digest.update(b"F" + relative + b"\0")
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def ensure_rootfs(report: Callable[[str], None]) -> Path:
    """The board root file system, built on first use and verified against its checksum on every use."""
    home = rootfs_dir()
    root = home / "rootfs"
    checksum = home / CHECKSUM_NAME
    if checksum.is_file():
        started = time.monotonic()
        if tree_digest(root) != checksum.read_text().strip():
            raise BuildError(f"the board root file system {root} does not match its checksum ({checksum}); "
                             f"remove {home} and run fleet up again to rebuild it")
        report(f"root file system {root} (checksum verified in {time.monotonic() - started:.1f} s)")
        return root
    if home.exists() and not is_owned(home):
        raise BuildError(f"{home} exists and was not created by edgetune; move it away")
    if home.exists():  # a build that stopped midway: ours, never checksummed, never used
        shutil.rmtree(home)
    started = time.monotonic()
    report(f"building the aarch64 root file system in {home} (once)")
    home.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=home.parent))
    try:
        _build_rootfs(building / "rootfs")
        (building / CHECKSUM_NAME).write_text(tree_digest(building / "rootfs") + "\n")
        mark_owned(building)
        building.rename(home)
    finally:
        if building.exists():
            shutil.rmtree(building)
    report(f"root file system built in {time.monotonic() - started:.0f} s")
    return root


def _build_rootfs(root: Path) -> None:
    """Debian's arm64 packages extracted (no maintainer scripts run), then the wheels and the launcher."""
    tool = shutil.which("mmdebstrap")
    if tool is None:
        raise BuildError("mmdebstrap is not installed; emulated boards need it and qemu-user "
                         "(apt-get install mmdebstrap qemu-user)")
    _run([tool, "--quiet", "--variant=extract", "--arch=arm64", f"--include={','.join(DEBIAN_PACKAGES)}",
          SUITE, str(root), MIRROR], "mmdebstrap")
    platforms = [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
    pins = [f"{name}=={version}" for name, version in board_versions().items()]
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--only-binary=:all:", *platforms,
          "--python-version", "3.11", "--target", str(root / SITE_DIR), *pins], "pip install (aarch64 wheels)")
    (root / SITE_DIR / "sitecustomize.py").write_text(_SITECUSTOMIZE_TEXT)
    (root / LAUNCHER).write_text(_LAUNCHER_TEXT)
    (root / LAUNCHER).chmod(0o755)
    # Compiled now (3.11 bytecode is the same here and there): boards then run with PYTHONDONTWRITEBYTECODE,
    # so the checksummed tree stays as built.
    _run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(root / "usr/lib/python3.11"), str(root / SITE_DIR)],
         "compileall")


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).splitlines()[-8:])
        raise BuildError(f"{what} failed (exit {result.returncode}) while building the board root file "
                         f"system:\n{tail}")


def state_dir(directory: Path | None = None) -> Path:
    """Pid files, logs and board descriptions of `fleet up --emulate` (default under the cache)."""
    return directory if directory is not None else cache_dir() / "fleet"


def board_for(profile_name: str, tracker_address: str, root: Path) -> Board:
    """The board a profile describes: an aarch64 profile, emulated with its own CPU model and core count."""
    if profile_name not in profile_names():
        raise InputError(f"--emulate: {unknown_profile_message(profile_name, profile_names())}")
    profile = load_profile(profile_name)
    if profile.isa != "aarch64" or profile.device != "cpu":
        raise InputError(f"--emulate {profile_name}: only aarch64 CPU boards can be emulated "
                         f"(this profile is {profile.isa}/{profile.device})")
    cpu = str(profile.target.get("mcpu", "max"))
    return Board(profile_name, profile_name, "aarch64", cpu, profile.hardware.cores, tracker_address, str(root))


def _files(state: Path, key: str) -> tuple[Path, Path, Path]:
    boards = state / "boards"
    return boards / f"{key}.pid", boards / f"{key}.log", boards / f"{key}.json"


@dataclass(frozen=True)
class _Launched:
    """A board's server started under qemu, not registered with the tracker yet."""

    board: Board
    process: subprocess.Popen
    servers_before: int  # servers under its key when it started
    started_at: float  # time.monotonic()


def port_block(index: int, count: int) -> range:
    """The ports board `index` of `count` started together scans: disjoint from every other board's."""
    size = len(_SERVER_PORTS) // count
    start = _SERVER_PORTS.start + index * size
    return range(start, start + size)


def launch_board(board: Board, state: Path, ports: range) -> _Launched | int:
    """Start the board's RPC server under qemu, listening on one of `ports` (`wait_registered` waits for it);
    the pid of the one already running instead."""
    pid_file, log_file, description = _files(state, board.key)
    pid = processes.running_pid(pid_file, _MARKER)
    if pid is not None:
        return pid
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        raise BuildError("qemu-aarch64 is not installed (apt-get install qemu-user)")
    root = Path(board.rootfs)
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTHON", "QEMU_"))}
    env.update(QEMU_LD_PREFIX=str(root), QEMU_CPU=board.qemu_cpu, PYTHONPATH=str(root / SITE_DIR),
               PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", EDGETUNE_BOARD_PYTHON=str(root / BOARD_PYTHON),
               EDGETUNE_BOARD_LAUNCHER=str(root / LAUNCHER), TVM_NUM_THREADS=str(board.cores))
    argv = [qemu, str(root / BOARD_PYTHON), "-m", _MARKER, "--host", "127.0.0.1", "--port", str(ports.start),
            "--port-end", str(ports.stop), "--tracker", board.tracker, "--key", board.key]
    description.parent.mkdir(parents=True, exist_ok=True)
    description.write_text(json.dumps({k: v for k, v in board.__dict__.items() if k != "pid"}, indent=1) + "\n")
    process = processes.start_detached(argv, pid_file, log_file, env=env)
    before = tracker.query(board.tracker).key(board.key).total
    return _Launched(board, process, before, time.monotonic())


def wait_registered(launched: _Launched, state: Path) -> int:
    """The launched board's pid once the tracker lists it; stopped, and an error naming its log, if it does not
    register in time."""
    board, process = launched.board, launched.process
    deadline = launched.started_at + _START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if tracker.wait_for_servers(board.tracker, board.key, launched.servers_before + 1, timeout_s=2.0):
            return process.pid
    pid_file, log_file, _ = _files(state, board.key)
    processes.stop(pid_file, _MARKER)
    raise BuildError(f"the emulated board '{board.key}' did not register with the tracker at {board.tracker} "
                     f"within {_START_TIMEOUT_S:.0f} s; its log ({log_file}) ends with:\n"
                     f"{processes.log_tail(log_file)}")


def boards(state: Path) -> list[Board]:
    """Every board `fleet up --emulate` recorded in `state`, with its pid when it still runs."""
    found = []
    for description in sorted((state / "boards").glob("*.json")):
        try:
            fields = json.loads(description.read_text())
            board = Board(**fields)
        except (OSError, ValueError, TypeError):
            continue
        pid = processes.running_pid(_files(state, board.key)[0], _MARKER)
        found.append(Board(**{**board.__dict__, "pid": pid}))
    return found


def serves_emulated(tracker_address: str, key: str) -> bool:
    """True when the servers under `key` listen on this machine in a qemu process: an emulated board.

    Asked of the processes themselves (whoever started them), so a real board, even one on loopback
    through an SSH tunnel, is never taken for an emulated one.
    """
    import psutil

    try:
        servers = tracker.query(tracker_address, timeout_s=2.0).servers
    except BuildError:
        return False
    ports = {int(address.rpartition(":")[2]) for address, served in servers
             if served == key and address.rpartition(":")[0] in ("127.0.0.1", "::1", "localhost")}
    if not ports:
        return False
    try:
        listeners = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid]
        programs = {Path(psutil.Process(c.pid).cmdline()[0]).name for c in listeners if c.laddr.port in ports}
    except (psutil.Error, IndexError):
        return False
    return bool(programs) and all(name.startswith("qemu-") for name in programs)


def up(profiles: list[str], tracker_port: int, state: Path, report: Callable[[str, str], None]) -> list[str]:
    """Start a tracker on 127.0.0.1:`tracker_port` (unless one runs there) and one board per profile."""
    spec = TrackerSpec(host="127.0.0.1", port=tracker_port)
    chosen = [board_for(name, spec.address, Path()) for name in dict.fromkeys(profiles)]
    root = ensure_rootfs(lambda what: report("boards", what))
    try:
        tracker.query(spec.address, timeout_s=2.0)
        report("tracker", f"using the tracker already answering at {spec.address}")
    except BuildError:
        pid, _ = tracker.start(spec, state)
        report("tracker", f"started on {spec.address} (pid {pid})")
    problems, launched = [], []
    for index, board in enumerate(chosen):  # all boot side by side: each is qemu starting Python and TVM
        board = Board(**{**board.__dict__, "rootfs": str(root)})
        try:
            started = launch_board(board, state, port_block(index, len(chosen)))
        except BuildError as exc:
            problems.append(str(exc))
            continue
        if isinstance(started, int):
            _report_board(report, board, started, "already running")
        else:
            launched.append(started)
    for started in launched:
        try:
            pid = wait_registered(started, state)
        except BuildError as exc:
            problems.append(str(exc))
            continue
        _report_board(report, started.board, pid, f"registered in {time.monotonic() - started.started_at:.0f} s")
    return problems


def _report_board(report: Callable[[str, str], None], board: Board, pid: int, what: str) -> None:
    report(board.key, f"emulated {board.arch} board (qemu -cpu {board.qemu_cpu}, {board.cores} threads), "
                      f"key '{board.key}' at {board.tracker}, pid {pid}: {what}")


def down(state: Path, report: Callable[[str, str], None]) -> list[str]:
    """Stop every board and the tracker `fleet up --emulate` started in `state`, and nothing else."""
    for board in boards(state):
        pid_file, _, description = _files(state, board.key)
        stopped = processes.stop(pid_file, _MARKER)
        description.unlink(missing_ok=True)
        report(board.key, f"stopped (pid {stopped})" if stopped else "was not running")
    stopped = tracker.stop(state)
    if stopped is not None:
        report("tracker", f"stopped (pid {stopped})")
    return []
