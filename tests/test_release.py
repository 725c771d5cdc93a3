"""Releases: several recipes in one `edgetune build`, serially, on a local process pool, and on a real Ray cluster
(two node processes on 127.0.0.1), with a worker killed in the middle of a build."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_edgetune
from edgetune.release import render_release_page

CROSS_RECIPE = """\
name: {name}
model: {{zoo: tiny_cnn}}
fleet:
  - {{name: rpi4, profile: raspberry-pi-4}}
  - {{name: a53, profile: cortex-a53}}
tuning: {{trials_per_task: 0}}
output: out
"""
"""Two aarch64 boards, nothing tuned or timed here: the same records give the same bytes wherever it is built."""

TUNED_RECIPE = """\
name: {name}
model: {{zoo: tiny_cnn}}
fleet:
  - {{name: host, profile: host}}
  - {{name: host-b, profile: host, overrides: {{target: {{num-cores: 1}}, hardware: {{cores: 1}}}}}}
tuning: {{trials_per_task: {trials}, max_tasks: 1, seed: 1, in_model_candidates: 1}}
package: {{thread_wait: spin}}
output: out
"""
"""Two host targets, tuned: the tuner's best packaged, timed one way each (the in-model comparison and how the
threads wait are tested elsewhere)."""
TRIALS = 2


def write_recipes(directory: Path, template: str, names: list[str], **fields) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / f"{name}.yaml").write_text(template.format(name=name, **fields))
    return [f"{name}.yaml" for name in names]


def archives(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.glob("out/*/*.tar.gz"))}


def record_lines(store: Path) -> list[str]:
    path = store / "database_tuning_record.json"
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def serial_release(tmp_path_factory) -> Path:
    """Two recipes x two boards built serially in one process: what the workers must reproduce byte for byte."""
    directory = tmp_path_factory.mktemp("serial")
    run = run_edgetune("build", *write_recipes(directory, CROSS_RECIPE, ["rel-a", "rel-b"]), cwd=directory,
                       timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(archives(directory)) == 4
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A real Ray cluster of two node processes (one CPU each) on 127.0.0.1, reached through its client port."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    port = _free_port()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "ray_client_server_port": port,
        "object_store_memory": 128 * 1024 * 1024})
    cluster.add_node(num_cpus=1, object_store_memory=128 * 1024 * 1024)
    cluster.wait_for_nodes()
    address = f"ray://127.0.0.1:{port}"
    _wait_for_client_server(address, timeout_s=120)
    yield address
    cluster.shutdown()


def _wait_for_client_server(address: str, timeout_s: float) -> None:
    """Until a client connects: a head that has just started refuses clients while its agents come up."""
    probe = f"import ray; ray.init({address!r}); ray.shutdown()"
    deadline = time.monotonic() + timeout_s
    while subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=timeout_s).returncode != 0:
        assert time.monotonic() < deadline, f"the Ray cluster at {address} took no client in {timeout_s} s"
        time.sleep(2)


def test_unreachable_ray_cluster_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    write_recipes(tmp_path, CROSS_RECIPE, ["lonely"])
    address = f"ray://127.0.0.1:{_free_port()}"
    env = {**os.environ, "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1", "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "1"}
    run = subprocess.run([sys.executable, "-m", "edgetune", "build", "lonely.yaml", "--workers", address],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"--workers {address}: no Ray cluster answered" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr


def test_bad_recipe_among_good_ones_exits_2_and_builds_nothing(tmp_path: Path) -> None:
    good = write_recipes(tmp_path, CROSS_RECIPE, ["good-a", "good-b"])
    (tmp_path / "bad.yaml").write_text(CROSS_RECIPE.format(name="bad").replace("cortex-a53", "no-such-board"))
    for workers in ([], ["--workers", "local:2"]):
        run = run_edgetune("build", good[0], "bad.yaml", good[1], *workers, cwd=tmp_path, timeout=120)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "bad.yaml" in run.stderr and "no-such-board" in run.stderr
        assert "Traceback" not in run.stderr
        assert not (tmp_path / "out").exists() and not (tmp_path / "release").exists()


def test_two_recipes_into_one_build_directory_and_bad_workers_exit_2(tmp_path: Path) -> None:
    write_recipes(tmp_path, CROSS_RECIPE, ["same"])
    (tmp_path / "copy.yaml").write_text((tmp_path / "same.yaml").read_text())
    run = run_edgetune("build", "same.yaml", "copy.yaml", cwd=tmp_path, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "copy.yaml: builds into" in run.stderr and "same.yaml" in run.stderr
    for spec in ("local:0", "ray:/host:1", "local:two"):
        run = run_edgetune("build", "same.yaml", "--workers", spec, cwd=tmp_path, timeout=120)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "expected local:N" in run.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "release").exists()


def test_release_page_escapes_every_name_and_path(tmp_path: Path) -> None:
    hostile = "<script>alert(1)</script>"
    target = {"error": f"failed: {hostile}", "verified": False, "verification": hostile, "latency_ms": None,
              "trials_total": 0, "trials_measured": 0, "artifact": f"/x/{hostile}\"/a.tar.gz"}
    summary = {"ok": False, "workers": hostile, "wall_s": 1.0, "recipes": [
        {"recipe": "r", "error": hostile, "build_dir": f"/x/{hostile}", "targets": {"t": target}}]}
    page = render_release_page(summary, tmp_path)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert 'href="' in page and '"/a.tar.gz' not in page


@pytest.mark.slow
def test_release_on_a_ray_cluster_gives_the_serial_bytes(serial_release: Path, ray_cluster: str,
                                                          tmp_path: Path) -> None:
    recipes = write_recipes(tmp_path, CROSS_RECIPE, ["rel-a", "rel-b"])
    run = run_edgetune("build", *recipes, "--workers", ray_cluster, "--release-dir", "rel", cwd=tmp_path,
                       timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert archives(tmp_path) == archives(serial_release)
    release = json.loads((tmp_path / "rel" / "release.json").read_text())
    assert release["ok"] and release["workers"] == ray_cluster
    assert {r["recipe"]: sorted(r["targets"]) for r in release["recipes"]} == {
        "rel-a": ["a53", "rpi4"], "rel-b": ["a53", "rpi4"]}
    for name in ("rel-a", "rel-b"):  # each recipe's own summary covers all its targets, as a serial build's does
        assert sorted(json.loads((tmp_path / "out" / name / "summary.json").read_text())["targets"]) == ["a53", "rpi4"]
    assert 'href="../out/rel-a/rpi4.tar.gz"' in (tmp_path / "rel" / "release.html").read_text()


@pytest.mark.slow
def test_process_pool_without_ray_gives_the_serial_bytes(serial_release: Path, tmp_path: Path) -> None:
    recipes = write_recipes(tmp_path, CROSS_RECIPE, ["rel-a", "rel-b"])
    env = {**os.environ, "EDGETUNE_NO_RAY": "1"}
    run = subprocess.run([sys.executable, "-m", "edgetune", "build", *recipes, "--workers", "local:2"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Ray" not in run.stdout + run.stderr
    assert archives(tmp_path) == archives(serial_release)
    assert json.loads((tmp_path / "release" / "release.json").read_text())["workers"] == "local:2"


def _unit_worker(timeout_s: float):
    """A Ray worker process while it runs a unit (Ray titles it after the task's function)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["cmdline"]):
            if (process.info["cmdline"] or [""])[0].startswith("ray::run_unit"):
                return process
        time.sleep(0.5)
    raise AssertionError("no Ray worker ran a unit")


@pytest.mark.slow
def test_worker_killed_mid_build_loses_no_record_and_the_release_finishes(ray_cluster: str, tmp_path: Path) -> None:
    recipes = write_recipes(tmp_path, TUNED_RECIPE, ["tuned"], trials=TRIALS)  # two units: one per node
    build = subprocess.Popen([sys.executable, "-m", "edgetune", "build", *recipes, "--workers", ray_cluster],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = _unit_worker(timeout_s=120)
    assert worker.nice() == os.nice(0)  # at the command's priority, not Ray's niceness 15
    while not list(tmp_path.glob("out/*/records/*/database_workload.json")) and build.poll() is None:
        time.sleep(0.2)  # the store is open: the unit is tuning
    committed = {p.parent: record_lines(p.parent) for p in tmp_path.glob("out/*/records/*/database_workload.json")}
    assert worker.cmdline()[0].startswith("ray::run_unit")  # still in the middle of its unit
    os.kill(worker.pid, signal.SIGKILL)
    output, _ = build.communicate(timeout=400)
    assert build.returncode == 0, output
    stores = sorted(tmp_path.glob("out/*/records/*/"))
    assert len(stores) == 2
    for store in stores:  # every store: one task's planned trials, each once
        lines = record_lines(store)
        assert len(lines) == TRIALS == len(set(lines)), store
        assert set(committed.get(store, [])) <= set(lines)  # what was committed before the kill is kept
    release = json.loads((tmp_path / "release" / "release.json").read_text())
    assert release["ok"]
    assert all(t["trials_total"] == TRIALS for r in release["recipes"] for t in r["targets"].values())


SHARDED_RECIPE = """\
name: sharded
model: {{zoo: tiny_cnn}}
fleet:
  - {{name: board, profile: host, connection: {{rpc: {{tracker: "{tracker}", key: {key}}}}}}}
tuning: {{trials_per_task: {trials}, max_tasks: 3, seed: 1}}
output: out
"""


def _shard_worker(build: subprocess.Popen, directory: Path, timeout_s: float):
    """A Ray worker running a shard job, once its shard store holds a workload (it is tuning)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and build.poll() is None:
        if list(directory.glob("out/sharded/records/*/shards/*/database_workload.json")):
            for process in psutil.process_iter(["cmdline"]):
                if (process.info["cmdline"] or [""])[0].startswith("ray::run_shard"):
                    return process
        time.sleep(0.2)
    raise AssertionError(f"no Ray worker tuned a shard: {build.stdout.read() if build.poll() is not None else ''}")


@pytest.mark.slow
def test_tuning_split_over_ray_workers_survives_a_killed_shard_worker(ray_cluster: str, tmp_path: Path) -> None:
    from test_fleet import KEY, kill, start_server, start_tracker

    from edgetune.fleet import tracker

    process, address = start_tracker(tmp_path)
    servers = [start_server(tmp_path, address), start_server(tmp_path, address)]
    try:
        assert tracker.wait_for_servers(address, KEY, 2, 90), "the RPC servers did not register"
        (tmp_path / "sharded.yaml").write_text(SHARDED_RECIPE.format(tracker=address, key=KEY, trials=TRIALS))
        build = subprocess.Popen([sys.executable, "-m", "edgetune", "build", "sharded.yaml", "--workers", ray_cluster],
                                 cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        shard_worker = _shard_worker(build, tmp_path, timeout_s=240)
        assert shard_worker.nice() == os.nice(0)  # at the command's priority, not Ray's niceness 15
        os.kill(shard_worker.pid, signal.SIGKILL)
        output, _ = build.communicate(timeout=400)
    finally:
        for server in servers:
            kill(server)
        kill(process)
    assert build.returncode == 0, output
    assert "shard 1/2: " in output and "shard 2/2: " in output
    summary = json.loads((tmp_path / "out" / "sharded" / "summary.json").read_text())["targets"]["board"]
    (store,) = tmp_path.glob("out/sharded/records/*/")
    lines = record_lines(store)
    assert len(lines) == len(set(lines)) == summary["trials_measured"]  # each measured once, all counted
    for task in summary["tasks"]:  # every task its trials (or every schedule its space has), none failed
        assert task["trials"] == TRIALS or (task["space_exhausted"] and task["trials"] >= 1), task
        assert task["tuning_failed"] is None
    assert not [p for p in (store / "shards").iterdir() if p.is_dir()]  # every shard merged and removed
    assert summary["verified"] and summary["tuning_curve"]


def test_targets_of_one_recipe_are_units_that_may_run_side_by_side(tmp_path: Path) -> None:
    from edgetune.recipe import load_recipe
    from edgetune.release import ReleaseRecipe, plan_units

    (tmp_path / "mixed.yaml").write_text("name: mixed\nmodel: {zoo: tiny_cnn}\nfleet:\n  - {name: host, profile: host}\n"
                                         "  - {name: rpi4, profile: raspberry-pi-4}\n"
                                         "  - {name: a53, profile: cortex-a53}\ntuning: {trials_per_task: 0}\noutput: out\n")
    item = ReleaseRecipe(load_recipe(tmp_path / "mixed.yaml"), "mixed.yaml", None)
    units = {p.unit.target: p for p in plan_units([item], None, None, task_workers=3)}
    assert not units["host"].after and not units["rpi4"].after  # different ISAs: neither waits for the other
    assert units["a53"].after == {units["rpi4"].unit.index}  # its sibling's records warm-start it
    assert not units["host"].resources & units["rpi4"].resources  # one record store each, no shared directory
    assert all(p.unit.task_workers == 3 for p in units.values())
