"""SSH to a device, the OpenSSH way: host keys checked against known_hosts, keys or agent only.

An unknown host key is refused (paramiko's RejectPolicy) unless the recipe opts into OpenSSH's
accept-new, which records it; a key that differs from the recorded one is refused either way
(paramiko compares known keys before it consults a policy). Passwords are never sent: a recipe
cannot hold one, and none is passed to paramiko.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import paramiko

from edgetune.errors import BuildError
from edgetune.recipe import SshSpec

CONNECT_TIMEOUT_S = 15.0


class UnknownHostKey(paramiko.SSHException):
    """The device's host key is not in known_hosts and the recipe does not accept new ones."""

    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"{hostname}: unknown host key {key.get_name()} {key.fingerprint}")
        self.hostname = hostname
        self.key = key


class _RejectUnknown(paramiko.RejectPolicy):
    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(hostname, key)


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Trust an unknown host's key and append it to the known_hosts file (keeping what is there)."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.known_hosts.open("a") as stream:
            stream.write(paramiko.hostkeys.HostKeyEntry([hostname], key).to_line())


def known_hosts_path(spec: SshSpec, base_dir: Path) -> Path:
    return (base_dir / Path(spec.known_hosts).expanduser()).resolve()


def key_file_path(spec: SshSpec, base_dir: Path) -> Path | None:
    return (base_dir / Path(spec.key_file).expanduser()).resolve() if spec.key_file else None


def connect(target: str, spec: SshSpec, base_dir: Path) -> paramiko.SSHClient:
    """A logged-in SSH client for the target's device, or a BuildError that says what to do."""
    known_hosts = known_hosts_path(spec, base_dir)
    key_file = key_file_path(spec, base_dir)
    client = paramiko.SSHClient()
    if known_hosts.is_file():
        client.load_host_keys(str(known_hosts))
    client.set_missing_host_key_policy(_AcceptNew(known_hosts) if spec.accept_new_host_key else _RejectUnknown())
    where = f"{spec.user}@{spec.host}:{spec.port}"
    try:
        client.connect(
            spec.host, spec.port, spec.user, key_filename=str(key_file) if key_file else None,
            allow_agent=True, look_for_keys=key_file is None, timeout=CONNECT_TIMEOUT_S,
            banner_timeout=CONNECT_TIMEOUT_S, auth_timeout=CONNECT_TIMEOUT_S,
        )
    except UnknownHostKey as exc:
        scan = f"ssh-keyscan -p {spec.port} {spec.host}" if spec.port != 22 else f"ssh-keyscan {spec.host}"
        raise BuildError(
            f"target '{target}': the SSH host key of {exc.hostname} ({exc.key.get_name()} {exc.key.fingerprint}) "
            f"is not in {known_hosts}; refusing to connect. Check that fingerprint on the device "
            f"(ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) and add the key ({scan} >> {known_hosts}), "
            "or set accept_new_host_key: true in its ssh connection to trust a host seen for the first time"
        ) from None
    except paramiko.BadHostKeyException as exc:
        raise BuildError(
            f"target '{target}': the SSH host key of {spec.host}:{spec.port} CHANGED: {known_hosts} has "
            f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}, the host offers "
            f"{exc.key.get_name()} {exc.key.fingerprint}; refusing to connect (this is what an interception "
            f"looks like). If the device was reinstalled, remove the old key: ssh-keygen -R "
            f"'[{spec.host}]:{spec.port}' -f {known_hosts}"
        ) from None
    except paramiko.PasswordRequiredException:
        raise BuildError(
            f"target '{target}': {key_file} is encrypted; load it into your SSH agent (ssh-add {key_file}) "
            "and leave key_file out of the recipe"
        ) from None
    except paramiko.AuthenticationException as exc:
        using = str(key_file) if key_file else "the SSH agent's keys and ~/.ssh/id_*"
        raise BuildError(
            f"target '{target}': cannot log in as {where} with {using} ({exc}); edgetune authenticates with "
            "keys only: add the public key to the device's ~/.ssh/authorized_keys"
        ) from None
    except (OSError, paramiko.SSHException) as exc:
        raise BuildError(f"target '{target}': cannot reach {where} over SSH: {exc}") from None
    return client


def run(client: paramiko.SSHClient, command: str, timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run a shell command on the device: (exit status, stdout, stderr)."""
    try:
        _, stdout, stderr = client.exec_command(command, timeout=timeout_s)
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
        return stdout.channel.recv_exit_status(), out, err
    except (TimeoutError, paramiko.SSHException) as exc:
        return -1, "", f"{type(exc).__name__}: {exc}"


def run_python(client: paramiko.SSHClient, python: str, script: str, argument: object = None,
               timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run a Python snippet with the device's Python; `argument` reaches it as JSON in sys.argv[1]."""
    command = f"{shlex.quote(python)} -c {shlex.quote(script)} {shlex.quote(json.dumps(argument))}"
    return run(client, command, timeout_s)
