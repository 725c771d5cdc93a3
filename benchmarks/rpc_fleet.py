"""What measuring on a device over TVM RPC costs, on this machine over loopback.

    python benchmarks/rpc_fleet.py --candidates 16 --rounds 3            # per-candidate overhead
    python benchmarks/rpc_fleet.py --builds --json out.json              # ... and a build with a server killed

1. Per-candidate overhead: the same built candidates (tiny_cnn's heaviest task, linked as `.so`
   files as edgetune's builder links them for a device) are measured by MetaSchedule's LocalRunner
   and by its RPCRunner through a real tracker and one real RPC server on 127.0.0.1, one worker
   each, alternating which goes first. Each runner measures one warm-up batch first (its worker
   process starts and imports TVM), then `rounds` timed batches.
2. With --builds: `edgetune build` of tiny_cnn (2 tasks x 4 trials) through a tracker and two RPC
   servers, undisturbed and with one server killed as soon as the first batch is in the records
   file (undisturbed, killed, killed, undisturbed). On a shared machine compare
   `after_first_batch_s` (the first batch lands to the build's end) rather than whole walls.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = """\
name: tiny
model: {zoo: tiny_cnn}
fleet:
  - name: board
    profile: host
    connection: {rpc: {tracker: "%s", key: bench, timeout_s: 10}}
tuning: {trials_per_task: 4, max_tasks: 2, seed: 1}
output: out
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as stream:
        return subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)


def start_tracker(directory: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return (spawn([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                   "--port-end", str(port + 1)], directory / "tracker.log"), f"127.0.0.1:{port}")


def start_server(directory: Path, address: str) -> subprocess.Popen:
    port = free_port()
    return spawn([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", address, "--key", "bench",
                  "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                 directory / f"server-{port}.log")


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def built_candidates(count: int) -> list:
    """RunnerInputs for `count` distinct schedules of tiny_cnn's heaviest task, linked as .so files."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    from edgetune.frontend.onnx import fuse_for_tuning, load_model, to_relax
    from edgetune.profiles import resolve_profile
    from edgetune.tuning.builder import linking_builder
    from edgetune.tuning.tasks import extract_tasks

    target = resolve_profile("host", None).tvm_target()
    task = extract_tasks(fuse_for_tuning(to_relax(load_model(zoo="tiny_cnn", onnx_path=None, input_shapes=None)),
                                         target), target)[0]
    context = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                             search_strategy="replay-trace", task_name=task.name, num_threads=2, rand_state=0)
    context.pre_tuning(max_trials=count, num_trials_per_iter=count, design_spaces=context.generate_design_space(),
                       database=ms.database.MemoryDatabase(), cost_model=None)
    candidates = context.generate_measure_candidates()
    builder = linking_builder(2, "gcc")
    built = builder.build([BuilderInput(c.sch.mod, target) for c in candidates])
    return [RunnerInput(b.artifact_path, "cpu", c.args_info) for b, c in zip(built, candidates) if b.error_msg is None]


def overhead(candidates: int, rounds: int, directory: Path) -> dict:
    from tvm.s_tir.meta_schedule.runner import LocalRunner, RPCConfig, RPCRunner

    from edgetune.fleet.tracker import wait_for_servers

    inputs = built_candidates(candidates)
    tracker, address = start_tracker(directory)
    server = start_server(directory, address)
    try:
        assert wait_for_servers(address, "bench", 1, 120), "the RPC server did not register"
        host, _, port = address.rpartition(":")
        runners = {"local": LocalRunner(), "rpc": RPCRunner(RPCConfig(host, int(port), "bench", 30), max_workers=1)}
        walls: dict[str, list[float]] = {name: [] for name in runners}
        failed = {name: 0 for name in runners}
        for name, runner in runners.items():  # warm-up: worker processes start and import TVM
            [f.result() for f in runner.run(inputs[:1])]
        for round_index in range(rounds):
            order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
            for name in order:
                started = time.perf_counter()
                results = [f.result() for f in runners[name].run(inputs)]
                walls[name].append(time.perf_counter() - started)
                failed[name] += sum(r.error_msg is not None for r in results)
    finally:
        stop(server)
        stop(tracker)
    per_candidate = {name: sorted(w)[len(w) // 2] / len(inputs) for name, w in walls.items()}
    return {
        "candidates": len(inputs), "rounds": rounds, "batch_wall_s": walls, "failed": failed,
        "per_candidate_s": per_candidate, "rpc_overhead_per_candidate_s": per_candidate["rpc"] - per_candidate["local"],
    }


def build_once(directory: Path, kill_one: bool) -> dict:
    directory.mkdir(parents=True)
    tracker, address = start_tracker(directory)
    servers = [start_server(directory, address), start_server(directory, address)]
    from edgetune.fleet.tracker import wait_for_servers

    try:
        assert wait_for_servers(address, "bench", 2, 120), "the RPC servers did not register"
        (directory / "tiny.yaml").write_text(TINY % address)
        records = directory / "out" / "tiny" / "work" / "board" / "records" / "database_tuning_record.json"
        started = time.monotonic()
        build = subprocess.Popen([sys.executable, "-m", "edgetune", "build", "tiny.yaml", "--json", "summary.json"],
                                 cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first_batch_at = None
        while first_batch_at is None and build.poll() is None:
            if records.exists() and records.read_text().strip():
                first_batch_at = time.monotonic() - started
                if kill_one:
                    stop(servers[0])
            time.sleep(0.2)
        output, _ = build.communicate()
        wall = time.monotonic() - started
    finally:
        for server in servers:
            stop(server)
        stop(tracker)
    summary = json.loads((directory / "summary.json").read_text())["targets"]["board"]
    failed = sum(float(json.loads(line)[1][1][0]) >= 1e9 for line in records.read_text().splitlines())
    return {"killed": kill_one, "first_batch_at_s": first_batch_at, "after_first_batch_s": wall - first_batch_at,
            "wall_s": wall, "returncode": build.returncode, "verified": summary["verified"],
            "trials_measured": summary["trials_measured"], "failed_records": failed,
            "output_tail": output.splitlines()[-3:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--builds", action="store_true", help="also time a build with and without a killed server")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = {"overhead": overhead(args.candidates, args.rounds, Path(scratch))}
        print(json.dumps(report["overhead"], indent=2), flush=True)
        if args.builds:
            report["builds"] = [build_once(Path(scratch) / f"build-{i}", kill_one=kill)
                                for i, kill in enumerate((False, True, True, False))]
            print(json.dumps(report["builds"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
