"""Detached processes on this machine, each known by a pid file, so `down` stops only what `up` started.

A process is started in a session of its own (setsid), so it outlives the command that started it
and its children (the tracker's and the tunnel's workers) share its process group. Before a pid is
signalled, its command line must still name what was started: a pid reused by another program is
left alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil


def start_detached(argv: list[str], pid_file: Path, log_file: Path,
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` in a new session (environment `env`, or this one's), output appended to `log_file`; its pid
    goes to `pid_file`.

    Wait on the returned process while it starts up: until it has exec'd, its command line is still
    the starter's, so `running_pid` cannot recognise it yet.
    """
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, close_fds=True, env=env)
    pid_file.write_text(f"{process.pid}\n")
    return process


def running_pid(pid_file: Path, marker: str) -> int | None:
    """The pid in `pid_file` if that process is alive and its command line contains `marker`."""
    try:
        pid = int(pid_file.read_text().strip())
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return pid if marker in " ".join(process.cmdline()) else None
    except (OSError, ValueError, psutil.Error):
        return None


def stop(pid_file: Path, marker: str, timeout_s: float = 10.0) -> int | None:
    """Stop the process group started under `pid_file` (TERM, then KILL); the pid stopped, or None.

    The pid file is removed either way: it no longer names a running process of ours.
    """
    pid = running_pid(pid_file, marker)
    if pid is not None:
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while running_pid(pid_file, marker) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        if running_pid(pid_file, marker) is not None:
            _signal_group(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return pid


def log_tail(log_file: Path, lines: int = 5) -> str:
    """The last lines of a log, for an error message."""
    try:
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _signal_group(pid: int, signum: int) -> None:
    try:
        if os.getpgid(pid) == pid:  # a session leader we started: its workers share the group
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass
