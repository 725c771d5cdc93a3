"""One target's tuning in one worker and split into shards over two: wall times and their ratio.

    python benchmarks/task_shards.py --trials 16 --max-tasks 6 --workers local:2 --seeds 1 2 3

Starts a real RPC tracker and two RPC servers on 127.0.0.1 (the "board" is this machine, reached through the
tracker as a real board would be), writes a tiny_cnn recipe whose one target is measured through them, and
runs the real `edgetune build` on it three times per seed, interleaved: serially, with `--workers local:1` (the
same workers' start-up, no split), and with `--workers` (the tuning split into shards of its tasks, one per
worker). Each run starts from empty records in its own directory. Prints each run's wall time and the ratios
serial / sharded and one worker / sharded (the split alone); on this 2-core machine the shards' searches,
their builders and the two servers' measurements all share the same two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rpc_fleet import start_server, start_tracker, stop  # benchmarks/: the same tracker and servers

RECIPE = """\
name: shards
model: {{zoo: tiny_cnn}}
fleet:
  - {{name: board, profile: host, connection: {{rpc: {{tracker: "{tracker}", key: bench}}}}}}
tuning: {{trials_per_task: {trials}, max_tasks: {max_tasks}, seed: {seed}}}
output: out
"""


def start_fleet(work: Path, servers: int) -> tuple[list[subprocess.Popen], str]:
    """A tracker and `servers` RPC servers under the key `bench`, registered before this returns."""
    from edgetune.fleet import tracker

    process, address = start_tracker(work)
    processes = [process] + [start_server(work, address) for _ in range(servers)]
    if not tracker.wait_for_servers(address, "bench", servers, 90):
        for process in processes:
            stop(process)
        raise SystemExit(f"the RPC servers did not register; see {work}/*.log")
    return processes, address


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
            for mode, workers in (("serial", None), ("one-worker", "local:1"), ("sharded", args.workers)):
                directory = work / f"seed{seed}-{mode}-{time.strftime('%H%M%S')}"
                directory.mkdir()
                (directory / "shards.yaml").write_text(RECIPE.format(tracker=address, trials=args.trials,
                                                                     max_tasks=args.max_tasks, seed=seed))
                row[f"{mode}_s"], row[f"{mode}_trials"] = timed_build(directory, workers)
                print(f"seed {seed} {mode:10s} {row[f'{mode}_s']:7.1f} s  {row[f'{mode}_trials']} trials", flush=True)
            row["ratio"] = row["serial_s"] / row["sharded_s"]
            row["split_ratio"] = row["one-worker_s"] / row["sharded_s"]
            rows.append(row)
    finally:
        for process in fleet:
            stop(process)
    for key, what in (("ratio", f"serial / sharded ({args.workers})"),
                      ("split_ratio", f"one worker (local:1) / sharded ({args.workers})")):
        ratios = [r[key] for r in rows]
        print(f"{what}: median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x, max {max(ratios):.2f}x "
              f"over {len(rows)} seeds")
    if args.json:
        args.json.write_text(json.dumps({"workers": args.workers, "trials": args.trials, "max_tasks": args.max_tasks,
                                         "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
