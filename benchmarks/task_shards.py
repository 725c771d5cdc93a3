"""One target's tuning in one worker and split into shards over two: wall times and their ratio.

    python benchmarks/task_shards.py --trials 16 --max-tasks 6 --workers local:2 --seeds 1 2 3

Starts a real RPC tracker and two RPC servers on 127.0.0.1 (the "board" is this machine, reached through the
tracker as a real board would be), writes a tiny_cnn recipe whose one target is measured through them, and
runs the real `edgetune build` on it twice per seed, interleaved: serially, then with `--workers` (the tuning
split into shards of its tasks, one per worker). Each run starts from empty records in its own directory.
Prints each run's wall time, and per seed serial / sharded; on this 2-core machine the two shards' searches
and the two servers' measurements share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

RECIPE = """\
name: shards
model: {{zoo: tiny_cnn}}
fleet:
  - {{name: board, profile: host, connection: {{rpc: {{tracker: "{tracker}", key: bench}}}}}}
tuning: {{trials_per_task: {trials}, max_tasks: {max_tasks}, seed: {seed}}}
output: out
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("ab") as stream:
        return subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True)


def start_fleet(work: Path, servers: int) -> tuple[list[subprocess.Popen], str]:
    """A tracker and `servers` RPC servers under the key `bench`, registered before this returns."""
    from edgetune.fleet import tracker

    port = _free_port()
    address = f"127.0.0.1:{port}"
    processes = [_start([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                         "--port-end", str(port + 1)], work / "tracker.log")]
    time.sleep(2)
    for index in range(servers):
        server_port = _free_port()
        processes.append(_start([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", address, "--key", "bench",
                                 "--host", "127.0.0.1", "--port", str(server_port), "--port-end",
                                 str(server_port + 1)], work / f"server-{index}.log"))
    if not tracker.wait_for_servers(address, "bench", servers, 90):
        stop_fleet(processes)
        raise SystemExit(f"the RPC servers did not register; see {work}/*.log")
    return processes, address


def stop_fleet(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def timed_build(directory: Path, workers: str | None) -> tuple[float, int]:
    """Wall seconds of one `edgetune build` and the trials it measured; raises when it does not exit 0."""
    command = [sys.executable, "-m", "edgetune", "build", "shards.yaml"] + (["--workers", workers] if workers else [])
    started = time.monotonic()
    run = subprocess.run(command, cwd=directory, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    summary = json.loads((directory / "out" / "shards" / "summary.json").read_text())
    return wall_s, summary["targets"]["board"]["trials_measured"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--max-tasks", type=int, default=6)
    parser.add_argument("--workers", default="local:2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--work", type=Path, default=Path("build/bench-shards"))
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    fleet, address = start_fleet(work, servers=2)
    rows = []
    try:
        for seed in args.seeds:
            row = {"seed": seed}
            for mode, workers in (("serial", None), ("sharded", args.workers)):
                directory = work / f"seed{seed}-{mode}-{time.strftime('%H%M%S')}"
                directory.mkdir()
                (directory / "shards.yaml").write_text(RECIPE.format(tracker=address, trials=args.trials,
                                                                     max_tasks=args.max_tasks, seed=seed))
                row[f"{mode}_s"], row[f"{mode}_trials"] = timed_build(directory, workers)
                print(f"seed {seed} {mode:8s} {row[f'{mode}_s']:7.1f} s  {row[f'{mode}_trials']} trials", flush=True)
            row["ratio"] = row["serial_s"] / row["sharded_s"]
            rows.append(row)
    finally:
        stop_fleet(fleet)
    ratios = [r["ratio"] for r in rows]
    print(f"serial / sharded ({args.workers}): median {statistics.median(ratios):.2f}x, "
          f"min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(rows)} seeds")
    if args.json:
        args.json.write_text(json.dumps({"workers": args.workers, "trials": args.trials, "max_tasks": args.max_tasks,
                                         "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
