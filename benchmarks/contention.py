"""A built artifact and ONNX Runtime on an idle machine and beside busy processes, with TVM's thread pool
spinning (its default) and sleeping (`TVM_THREAD_POOL_SPIN_COUNT=0`), and in edgetune's thread pool
(edgetune/thread_pool.py: the artifact's threads.so, or one built here with this machine's C compiler).

    python benchmarks/contention.py build/host-resnet18/host --model resnet18 --rounds 3
    python benchmarks/contention.py ART --onnx model.onnx --input-shapes '{"x": [1, 3, 224, 224]}'
    python benchmarks/contention.py ART --model resnet18 --spin-counts 300000 1000 0 --loads idle "nice 19"

TVM's runtime runs a parallel loop as one static share per thread, and a thread waiting for work (a
worker between loops, the caller for its workers) yields the core up to 300,000 times before it sleeps.
Beside another busy process on the same cores, every yield hands that process the core; the loop then
waits for its slowest share. This benchmark shows what that costs: for each load (idle, `--hogs` busy
loops at nice 19, the same at normal priority), the artifact with each spin count and ONNX Runtime
(2 threads each) are timed in turns, each in a process of its own (TVM reads the spin count once, when
its pool starts), `--rounds` times. Printed: the median of each system's rounds per load, in ms, and
each against ONNX Runtime under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifact_source import add_artifact_source, load_source_model, source_argv
from busy_machine import cpu_hogs

from edgetune.profiles import load_profile
from edgetune.runtime import SPIN_COUNT_ENV
from edgetune.thread_pool import POOL_LIBRARY_NAME, build_thread_pool
from edgetune.toolchains import resolve_toolchain

DEFAULT_SPIN_COUNTS = (300_000, 0)
"""TVM's default (spins) and sleeping; `--spin-counts` times others (a thread yields that many times, then sleeps)."""
ORT = "onnxruntime"
POOL = "edgetune pool"
POOL_ENV = "EDGETUNE_BENCHMARK_POOL"
"""Set for the pool's timing process: the thread pool's library, started once the model is loaded."""
LOADS = {"idle": (0, None), "nice 19": (1, 19), "normal": (1, None)}
"""Per load: busy loops per `--hogs`, and their nice value."""


def child(args: argparse.Namespace) -> None:
    """Time one system (this process's TVM pool policy comes from its environment): print its median ms."""
    import e2e  # noqa: F401  (sets the thread counts first)
    import tvm
    from timing import sample_calls

    from edgetune.reference import ReferenceRuntime
    from edgetune.runtime import load_library

    model = load_source_model(args)
    x = model.sample_inputs()[model.inputs[0].name]
    if args.child == ORT:
        session = ReferenceRuntime(model)._session(2)
        runner = lambda: session.run(None, {model.inputs[0].name: x})
    else:
        device = tvm.cpu(0)
        pool = Path(os.environ[POOL_ENV]) if os.environ.get(POOL_ENV) else None
        vm, tvm_x = load_library(args.artifact / "model.so", device, pool, 2), tvm.runtime.tensor(x, device)
        runner = lambda: vm["main"](tvm_x)
    runner()  # warm-up: allocation, the thread pool
    print(json.dumps(float(np.median(sample_calls(runner, args.seconds, 5))) * 1e3))


def systems(spin_counts: list[int], pool: Path) -> dict[str, dict[str, str]]:
    """Each system's name and the environment its process starts with (TVM reads the spin count once)."""
    named = {f"tvm (spin {count})": {SPIN_COUNT_ENV: str(count)} for count in spin_counts}
    return {**named, POOL: {SPIN_COUNT_ENV: "0", POOL_ENV: str(pool)}, ORT: {}}


def time_in_child(args: argparse.Namespace, system: str) -> float:
    child_kind = ORT if system == ORT else "tvm"
    command = [sys.executable, __file__, *source_argv(args), "--child", child_kind, "--seconds", str(args.seconds)]
    environment = {**os.environ, **systems(args.spin_counts, args.pool)[system]}
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise SystemExit(f"timing {system} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def under_load(args: argparse.Namespace, load: str) -> dict[str, list[float]]:
    """Every system timed `--rounds` times, in turns (order rotating), beside the load's busy loops."""
    per_hog, nice = LOADS[load]
    names = list(systems(args.spin_counts, args.pool))
    times: dict[str, list[float]] = {system: [] for system in names}
    with cpu_hogs(per_hog * args.hogs, nice):
        time.sleep(0.5)
        for turn in range(args.rounds):
            for system in names[turn % len(names):] + names[:turn % len(names)]:
                times[system].append(time_in_child(args, system))
    return times


def main() -> int:
    parser = add_artifact_source(argparse.ArgumentParser(description=__doc__,
                                                         formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--hogs", type=int, default=1, help="busy loops beside the timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="of calls per timing")
    parser.add_argument("--spin-counts", type=int, nargs="+", default=list(DEFAULT_SPIN_COUNTS),
                        help="TVM thread-pool spin counts to time (0: threads sleep at once)")
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--child", choices=["tvm", ORT], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.spin_counts) < 0:
        parser.error("--spin-counts: a count is 0 or more")
    if args.child:
        child(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="edgetune-contention-") as scratch:
        args.pool = args.artifact / POOL_LIBRARY_NAME
        if not args.pool.is_file():  # an artifact that ships TVM's pool: edgetune's built for this machine
            args.pool = build_thread_pool(resolve_toolchain(load_profile("host")).cc, Path(scratch) / POOL_LIBRARY_NAME)
        print(f"{args.hogs} busy loop(s) beside; median of {args.rounds} rounds, ms (x: ONNX Runtime's time / its "
              "time)")
        print(f"{'load':10s}" + "".join(f"{system:>22s}" for system in systems(args.spin_counts, args.pool)))
        for load in args.loads:
            times = {system: float(np.median(v)) for system, v in under_load(args, load).items()}
            ort = times[ORT]
            print(f"{load:10s}" + "".join(f"{ms:>14.2f} ({ort / ms:4.2f}x)" for ms in times.values()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
