"""Emulated aarch64 boards: real arm64 Debian userlands running TVM's RPC server under qemu-aarch64.

`edgetune fleet up --emulate` starts two boards on 127.0.0.1 (its root file system is built once into
$EDGETUNE_CACHE/boards and reused), and `recipes/emulated-arm.yaml` is built against them with 2 trials
on one task: candidates cross-compiled here, timed on the boards, the second board warm-started from the
first's records, and the artifacts run on the boards. Needs mmdebstrap and qemu-user (scripts/test
installs them) and PyPI for the aarch64 wheels on the first run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import run_edgetune as edgetune

from edgetune.fleet import emulated, tracker
from edgetune.profiles import load_profile, profile_names

REPO = Path(__file__).resolve().parent.parent
PROFILES = ("raspberry-pi-4", "cortex-a53")
pytestmark = pytest.mark.skipif(shutil.which("qemu-aarch64") is None or shutil.which("mmdebstrap") is None,
                                reason="needs qemu-user and mmdebstrap (scripts/test installs them)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[int, Path]:
    """Two emulated boards registered on a tracker of their own; stopped after the module's tests."""
    state = tmp_path_factory.mktemp("emulated-fleet")
    port = free_port()
    args = [a for profile in PROFILES for a in ("--emulate", profile)]
    up = edgetune("fleet", "up", *args, "--tracker-port", str(port), "--state-dir", str(state), timeout=900)
    assert up.returncode == 0, up.stdout + up.stderr
    yield port, state
    edgetune("fleet", "down", "--state-dir", str(state))


def board_pids(state: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted((state / "boards").glob("*.pid"))]


@pytest.mark.slow
def test_fleet_up_starts_aarch64_boards_that_fleet_status_lists(fleet):
    port, state = fleet
    status = edgetune("fleet", "status", "--state-dir", str(state))
    assert status.returncode == 0, status.stdout + status.stderr
    for key, cpu in (("raspberry-pi-4", "cortex-a72"), ("cortex-a53", "cortex-a53")):
        row = next(line for line in status.stdout.splitlines() if f" {key} " in line)
        assert "aarch64" in row and f"qemu -cpu {cpu}" in row and f"127.0.0.1:{port}" in row, row
        assert emulated.serves_emulated(f"127.0.0.1:{port}", key)
    for pid in board_pids(state):
        assert "qemu-aarch64" in psutil.Process(pid).cmdline()[0]
    servers = tracker.query(f"127.0.0.1:{port}").servers
    for index, key in enumerate(PROFILES):  # each in a port block of its own: no race for one port at start
        ports = [int(address.rpartition(":")[2]) for address, served in servers if served == key]
        assert ports and all(p in emulated.port_block(index, len(PROFILES)) for p in ports), (key, servers)
    root = Path(json.loads((state / "boards" / "cortex-a53.json").read_text())["rootfs"])
    assert (root / emulated.BOARD_PYTHON).resolve().read_bytes()[18:20] == (183).to_bytes(2, "little")  # EM_AARCH64
    assert emulated.tree_digest(root) == (root.parent / emulated.CHECKSUM_NAME).read_text().strip()


@pytest.mark.slow
def test_recipe_tunes_both_boards_over_rpc_transfers_and_verifies_on_them(fleet, tmp_path):
    port, state = fleet
    recipe = yaml.safe_load((REPO / "recipes" / "emulated-arm.yaml").read_text())
    recipe["fleet"] = [t for t in recipe["fleet"] if t["name"] != "host"]  # the host path is tested elsewhere
    for target in recipe["fleet"]:
        target["connection"]["rpc"]["tracker"] = f"127.0.0.1:{port}"
    recipe["tuning"].update(trials_per_task=2, max_tasks=1)
    recipe["package"] = {**recipe.get("package", {}), "thread_wait": "sleep"}  # boards shared with other work
    recipe["output"] = str(tmp_path / "build")
    (tmp_path / "arm.yaml").write_text(yaml.safe_dump(recipe))
    build = edgetune("build", "arm.yaml", "--json", "summary.json", cwd=tmp_path, timeout=900)
    assert build.returncode == 0, build.stdout + build.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name, key in (("rpi4", "raspberry-pi-4"), ("a53-board", "cortex-a53")):
        result = summary["targets"][name]
        assert result["device"]["arch"] == "aarch64" and result["device"]["via"] == "rpc"
        assert result["device"]["emulated"] is True and result["device"]["key"] == key
        assert "not the device's" in result["device"]["note"]
        assert result["trials_measured"] == 2 and result["verified"] is True
        assert all(task["best_us"] is not None for task in result["tasks"])  # timed on the board, not failed
        manifest = json.loads((Path(result["artifact_dir"]) / "manifest.json").read_text())
        assert any(method.startswith(f"TVM's runtime on the device, rpc key {key}")
                   for method in manifest["verification"]["methods"])
        assert "emulated board" in manifest["measured_on"]
        # timed over RPC in the server's own environment, the artifact still ships the recipe's way of waiting
        assert manifest["thread_wait"] == {"policy": "sleep", "chosen_by": "recipe", "spinning_ms": None,
                                           "sleeping_ms": None, "spinning_busy_ms": None, "sleeping_busy_ms": None,
                                           "pooled_ms": None, "pooled_busy_ms": None,
                                           "timed_beside_other_programs": False}
        assert json.loads((Path(result["artifact_dir"]) / "io.json").read_text())["cpu_thread_spin_count"] == 0
        assert "sleeps\nat once, as the recipe asked" in (Path(result["artifact_dir"]) / "README.md").read_text()
        log = (state / "boards" / f"{key}.log").read_text()
        assert "candidate.so" in log and "model.so" in log  # candidates and the artifact were loaded there
    transfer = summary["targets"]["a53-board"]["transfer"]
    assert transfer["used"] is True and transfer["sources"] == ["rpi4"] and transfer["seeds_measured"] > 0
    assert summary["targets"]["rpi4"]["transfer"] is None
    first = json.loads(next((tmp_path / "build").rglob("a53-board-*/tuning_log.jsonl")).read_text().splitlines()[0])
    assert first["measured"] == 1 and first["batch_best_us"] is not None  # the sibling's seed, timed on the board


@pytest.mark.slow
def test_a_board_killed_mid_tune_loses_no_record_and_the_build_resumes(fleet, tmp_path):
    port, state = fleet
    recipe = yaml.safe_load((REPO / "recipes" / "emulated-arm.yaml").read_text())
    board = next(t for t in recipe["fleet"] if t["name"] == "a53-board")
    board.pop("transfer_from")
    board["connection"]["rpc"]["tracker"] = f"127.0.0.1:{port}"
    recipe.update(fleet=[board], output=str(tmp_path / "build"))
    recipe["tuning"].update(trials_per_task=2, max_tasks=2)
    (tmp_path / "a53.yaml").write_text(yaml.safe_dump(recipe))
    with (tmp_path / "build.log").open("w") as log:
        build = subprocess.Popen([sys.executable, "-m", "edgetune", "build", "a53.yaml"], cwd=tmp_path,
                                 stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while not _committed(tmp_path) and build.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _committed(tmp_path), (tmp_path / "build.log").read_text()  # the first task's batch is in
        os.killpg((pid := int((state / "boards" / "cortex-a53.pid").read_text())), signal.SIGKILL)
        assert build.wait(timeout=600) == 1
    assert "no RPC server left under key 'cortex-a53'" in (tmp_path / "build.log").read_text()
    store = next((tmp_path / "build" / "emulated-arm" / "records").glob("a53-board-*"))
    kept = (store / "database_tuning_record.json").read_text().splitlines()
    committed = sum(json.loads(line)["measured"] for line in _committed(tmp_path))
    assert len(kept) >= committed >= 1  # every committed batch's records are there
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    up = edgetune("fleet", "up", "--emulate", "cortex-a53", "--tracker-port", str(port), "--state-dir", str(state),
                  timeout=900)
    assert up.returncode == 0, up.stdout + up.stderr
    resumed = edgetune("build", "a53.yaml", "--json", "summary.json", cwd=tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    result = json.loads((tmp_path / "summary.json").read_text())["targets"]["a53-board"]
    assert result["trials_total"] == 4 and result["verified"] is True
    assert sum(task["trials_measured_now"] for task in result["tasks"]) == 4 - len(kept)
    assert (store / "database_tuning_record.json").read_text().splitlines()[:len(kept)] == kept


def _committed(directory: Path) -> list[str]:
    """The tuning log's lines: one per batch of a task committed to the record store, with its `measured` count."""
    logs = list((directory / "build" / "emulated-arm" / "records").glob("a53-board-*/tuning_log.jsonl"))
    return logs[0].read_text().splitlines() if logs else []


def test_boards_started_together_scan_disjoint_ports():
    boards = [name for name in profile_names() if load_profile(name).isa == "aarch64"
              and load_profile(name).device == "cpu"]
    for count in range(1, len(boards) + 1):
        blocks = [set(emulated.port_block(index, count)) for index in range(count)]
        assert all(len(block) >= 10 for block in blocks)
        assert sum(len(block) for block in blocks) == len(set().union(*blocks))


def test_emulate_rejects_a_board_it_cannot_emulate(tmp_path):
    for profile, expected in (("jetson-orin", "only aarch64 CPU boards"), ("raspbery-pi-4", "did you mean")):
        run = edgetune("fleet", "up", "--emulate", profile, "--state-dir", str(tmp_path / "state"))
        assert run.returncode == 2 and expected in run.stderr, run.stderr
    assert not (tmp_path / "state").exists()
    both = edgetune("fleet", "up", "recipes/emulated-arm.yaml", "--emulate", "cortex-a53", cwd=REPO)
    assert both.returncode == 2 and "not both" in both.stderr


def test_a_root_file_system_that_fails_its_checksum_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETUNE_CACHE", str(tmp_path / "cache"))
    home = emulated.rootfs_dir()
    (home / "rootfs" / "usr" / "bin").mkdir(parents=True)
    (home / "rootfs" / "usr" / "bin" / "python3.11").write_text("changed after it was checksummed")
    (home / emulated.CHECKSUM_NAME).write_text("0" * 64 + "\n")
    run = edgetune("fleet", "up", "--emulate", "cortex-a53", "--state-dir", str(tmp_path / "state"),
                   "--tracker-port", str(free_port()))
    assert run.returncode == 1 and "does not match its checksum" in run.stderr, run.stdout + run.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.slow
def test_fleet_down_stops_the_boards_and_the_tracker(fleet):
    _port, state = fleet
    pids = board_pids(state)
    down = edgetune("fleet", "down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert pids and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                            for pid in pids)
    assert edgetune("fleet", "status", "--state-dir", str(state)).returncode == 1
