"""A release of several recipes built serially and with local workers: wall times and their ratio.

    python benchmarks/release.py --recipes 4 --workers local:2 --trials 0 --json out.json

Writes `--recipes` copies of a tiny_cnn recipe (names release-0..N-1, two targets each: this machine and a
Raspberry Pi 4 cross-compiled here; `--trials` per task, `--max-tasks` tasks tuned) into a fresh directory
under `--work` and runs the real `edgetune build` twice on them: serially (one process) and with
`--workers`, each into its own output directory so neither reuses the other's artifacts or records.
Prints both wall times and serial / parallel. On a shared 2-core machine expect little gain: each unit
loads the model and imports TVM in its worker, and the workers compete for the same cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RECIPE = """\
name: release-{index}
model: {{zoo: tiny_cnn}}
fleet:
  - {{name: host, profile: host}}
  - {{name: rpi4, profile: raspberry-pi-4}}
tuning: {{trials_per_task: {trials}, max_tasks: {max_tasks}, seed: {index}}}
output: out
"""


def write_recipes(directory: Path, count: int, trials: int, max_tasks: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for index in range(count):
        (directory / f"r{index}.yaml").write_text(RECIPE.format(index=index, trials=trials, max_tasks=max_tasks))
        names.append(f"r{index}.yaml")
    return names


def timed_build(directory: Path, recipes: list[str], workers: str | None) -> float:
    """Wall seconds of one `edgetune build` of every recipe; raises when it does not exit 0."""
    command = [sys.executable, "-m", "edgetune", "build", *recipes] + (["--workers", workers] if workers else [])
    started = time.monotonic()
    run = subprocess.run(command, cwd=directory, capture_output=True, text=True)
    wall_s = time.monotonic() - started
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", type=int, default=4)
    parser.add_argument("--workers", default="local:2")
    parser.add_argument("--trials", type=int, default=0, help="trials per task (0: compile and package only)")
    parser.add_argument("--max-tasks", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("build/bench-release"))
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    serial_dir, parallel_dir = args.work / f"{stamp}-serial", args.work / f"{stamp}-workers"
    recipes = write_recipes(serial_dir, args.recipes, args.trials, args.max_tasks)
    write_recipes(parallel_dir, args.recipes, args.trials, args.max_tasks)
    serial_s = timed_build(serial_dir, recipes, None)
    parallel_s = timed_build(parallel_dir, recipes, args.workers)
    result = {"recipes": args.recipes, "targets": 2 * args.recipes, "trials_per_task": args.trials,
              "workers": args.workers, "serial_s": round(serial_s, 2), "parallel_s": round(parallel_s, 2),
              "serial_over_parallel": round(serial_s / parallel_s, 3)}
    print(f"{args.recipes} recipes x 2 targets, trials_per_task {args.trials}: serial {serial_s:.1f} s, "
          f"{args.workers} {parallel_s:.1f} s, ratio serial/parallel {serial_s / parallel_s:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
