"""Where a built model's time goes: each kernel's time inside the model against its tuned time, and the rest
(TVM's runtime, the operating system, cores left idle), without a hook on every call.

    python benchmarks/overhead.py build/host-resnet18/host --model resnet18 --summary build/summary.json
    python benchmarks/overhead.py OUT/host --onnx model.onnx --input-shapes '{"x": [1, 3, 224, 224]}'

A child process runs the artifact's model.so in a loop, its TVM threads waiting both ways in turn (spinning, TVM's
default, and sleeping, as `io.json`'s `cpu_thread_spin_count: 0` ships them), while `perf record` samples it
(Linux `perf`, `--seconds` each). The library's samples are mapped to its kernels by the symbols `nm` lists; every
figure is per inference and, for CPU time, divided by the threads, so that the parts add up to the wall time: the
kernels, TVM's runtime (the VM, its thread pool, the allocator), the operating system (waking and yielding
threads, page faults), and the time no thread ran (a thread waiting for a wake-up, or for the other's share of a
loop). `--summary` (a build's summary.json) adds each tuned task's time (its best, times the calls per inference
of every kernel sharing its schedule: listed beside the task's own kernel, so compare the sums). The VM's
instrument hook (`layers.py`) costs each call a Python round trip: on a MobileNet-V2 its profiled total was 31%
over the plain time; sampling at 2000 Hz interrupts each thread every 0.5 ms instead. Samples are counted, not
read as perf's rounded percentages (see `sampled_counts`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TVM_NUM_THREADS", os.environ.get("E2E_THREADS", "2"))

import argparse
import bisect
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifact_source import add_artifact_source, checked_artifact, load_source_model, source_argv

WAYS = {"spin": None, "sleep": "0"}
"""TVM_THREAD_POOL_SPIN_COUNT per way its threads wait (None: TVM's default, which spins)."""
SAMPLES_PER_S = 2000
KERNEL_AFFIXES = ("__tvm_ffi_", "_compute_", "_prepacked")
"""What TVM adds to a kernel's name in its symbols: the packed entry point, the parallel loop's body, a kernel
with its weights packed at compile time."""
RUNTIME_LIBRARIES = ("libtvm_runtime", "libtvm_ffi", "libpython", "libc.so", "libstdc++", "core.cpython", "libm.so")


@dataclass
class Breakdown:
    """One way's figures, in microseconds per inference."""

    way: str
    wall_us: float
    threads: int
    kernels: dict[str, float] = field(default_factory=dict)
    runtime_us: float = 0.0
    system_us: float = 0.0
    other_us: float = 0.0

    @property
    def idle_us(self) -> float:
        return self.wall_us - sum(self.kernels.values()) - self.runtime_us - self.system_us - self.other_us


def kernel_name(symbol: str) -> str:
    """A kernel's name from one of its symbols (see KERNEL_AFFIXES)."""
    symbol = symbol.removeprefix(KERNEL_AFFIXES[0]).removesuffix(KERNEL_AFFIXES[1])
    return symbol.removesuffix(KERNEL_AFFIXES[2])


def library_symbols(library: Path) -> tuple[list[int], list[str]]:
    """The library's function symbols (`nm -n`), by address."""
    listing = subprocess.run(["nm", "-n", str(library)], capture_output=True, text=True, check=True).stdout
    addresses, names = [], []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "tT":
            addresses.append(int(parts[0], 16))
            names.append(parts[2])
    return addresses, names


def sampled_counts(perf_data: Path, library: Path) -> dict[tuple[str, str], int]:
    """Samples by (where, name): where is `kernel` (name: the kernel), `runtime`, `system` or `other` (name: the
    shared object). Counted, not read as percentages: perf lists each address it cannot name apart, and thousands
    of those, each shown as 0.00%, held a fifth of a GoogLeNet's samples."""
    report = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--sort", "dso,sym", "-F",
                             "sample,dso,sym", "-g", "none", "--percent-limit", "0", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    addresses, names = library_symbols(library)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for match in re.finditer(r"^\s*(\d+)\s+(\S+)\s+\[[.k]\]\s+(\S+)", report, re.MULTILINE):
        samples, dso, symbol = int(match[1]), match[2], match[3]
        if dso == library.name:
            if symbol.startswith("0x"):  # perf left it unnamed: the address in the library, as nm lists it
                at = bisect.bisect_right(addresses, int(symbol, 16)) - 1
                symbol = names[at] if at >= 0 else symbol
            counts["kernel", kernel_name(symbol)] += samples
        elif dso.startswith("[kernel"):
            counts["system", dso] += samples
        elif dso.startswith(RUNTIME_LIBRARIES):
            counts["runtime", dso] += samples
        else:
            counts["other", dso] += samples
    return counts


def breakdown(way: str, wall_ms: float, seconds: float, threads: int, counts: dict[tuple[str, str], int]
              ) -> Breakdown:
    """Samples turned into microseconds per inference, each part's CPU time divided by the threads."""
    inferences = seconds / (wall_ms / 1e3)
    per_sample_us = 1e6 / SAMPLES_PER_S / inferences / threads
    result = Breakdown(way, wall_ms * 1e3, threads)
    for (where, name), samples in counts.items():
        if where == "kernel":
            result.kernels[name] = result.kernels.get(name, 0.0) + samples * per_sample_us
        else:
            setattr(result, f"{where}_us", getattr(result, f"{where}_us") + samples * per_sample_us)
    return result


def profile_way(way: str, args: argparse.Namespace, scratch: Path) -> Breakdown:
    """The model run in a child process waiting `way`, sampled for `--seconds` once it is warm."""
    environment = {k: v for k, v in os.environ.items() if k != "TVM_THREAD_POOL_SPIN_COUNT"}
    if WAYS[way] is not None:
        environment["TVM_THREAD_POOL_SPIN_COUNT"] = WAYS[way]
    run_s = args.seconds + 3.0
    child = subprocess.Popen([sys.executable, __file__, "--child", str(run_s), *args.model_argv],
                             stdout=subprocess.PIPE, text=True, env=environment)
    assert child.stdout is not None
    if child.stdout.readline().strip() != "warm":
        raise SystemExit(f"the model did not run ({way}); its output is above")
    time.sleep(0.5)
    perf_data = scratch / f"{way}.data"
    recorded = subprocess.run(["perf", "record", "-F", str(SAMPLES_PER_S), "-p", str(child.pid), "-o", str(perf_data),
                               "--", "sleep", str(args.seconds)], check=False, capture_output=True,
                              text=True)
    wall_ms = json.loads(child.stdout.readline())["median_ms"]
    child.wait()
    if recorded.returncode != 0:
        raise SystemExit(f"perf record failed: {recorded.stderr.strip()[-400:]}")
    counts = sampled_counts(perf_data, args.artifact / "model.so")
    return breakdown(way, wall_ms, args.seconds, int(os.environ["TVM_NUM_THREADS"]), counts)


def run_child(run_s: float, model_argv: list[str]) -> None:
    """The child: load the model, say "warm" after a few calls, call it for `run_s` seconds, print the median."""
    import numpy as np
    import tvm

    from edgetune.runtime import load_library

    known = add_artifact_source(argparse.ArgumentParser()).parse_args(model_argv)
    model = load_source_model(known)
    feed = model.sample_inputs()
    vm = load_library(known.artifact / "model.so", tvm.cpu(0))
    inputs = [tvm.runtime.tensor(feed[i.name], tvm.cpu(0)) for i in model.inputs]
    for _ in range(10):
        vm["main"](*inputs)
    print("warm", flush=True)
    samples, ends = [], time.monotonic() + run_s
    while time.monotonic() < ends:
        started = time.perf_counter()
        vm["main"](*inputs)
        samples.append(time.perf_counter() - started)
    print(json.dumps({"median_ms": float(np.median(samples)) * 1e3}), flush=True)


def tuned_us(summary: Path | None) -> dict[str, float]:
    """Each tuned kernel's best time times its calls per inference, from a build's summary.json (its first target)."""
    if summary is None:
        return {}
    targets = json.loads(summary.read_text())["targets"]
    target = targets[0] if isinstance(targets, list) else next(iter(targets.values()))
    return {task["name"]: task["weight"] * task["best_us"] for task in target["tasks"] if task.get("best_us")}


def print_report(ways: list[Breakdown], tuned: dict[str, float], top: int) -> None:
    names = sorted({n for b in ways for n in b.kernels}, key=lambda n: -max(b.kernels.get(n, 0.0) for b in ways))
    header = "".join(f"{b.way + ' us':>12}" for b in ways) + ("    tuned us" if tuned else "")
    print(f"{'kernel':44} {header}")
    for name in names[:top]:
        cells = "".join(f"{b.kernels.get(name, 0.0):12.1f}" for b in ways)
        print(f"{name[:44]:44} {cells}" + (f"{tuned[name]:12.1f}" if name in tuned else ""))
    print(f"({len(names) - min(top, len(names))} more kernels)" if len(names) > top else "")
    rows = [("wall time", lambda b: b.wall_us), ("kernels", lambda b: sum(b.kernels.values())),
            ("TVM runtime, Python, libc", lambda b: b.runtime_us), ("operating system", lambda b: b.system_us),
            ("other libraries", lambda b: b.other_us), ("no thread running", lambda b: b.idle_us)]
    for label, value in rows:
        print(f"{label:44} " + "".join(f"{value(b):12.1f}" for b in ways)
              + "".join(f"  {value(b) / b.wall_us:5.1%} ({b.way})" for b in ways if label != "wall time"))
    if tuned:
        print(f"{'tuned kernels, summed':44} {sum(tuned.values()):12.1f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        run_child(float(argv[1]), argv[2:])
        return 0
    parser = add_artifact_source(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--summary", type=Path, help="the build's summary.json: each kernel's tuned time beside")
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS))
    parser.add_argument("--seconds", type=float, default=8.0, help="sampled per way")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None or shutil.which("nm") is None:
        raise SystemExit("needs Linux `perf` and `nm` (apt-get install linux-perf binutils)")
    checked_artifact(args)
    args.model_argv = source_argv(args)
    with tempfile.TemporaryDirectory(prefix="edgetune-overhead-") as scratch:
        ways = [profile_way(way, args, Path(scratch)) for way in args.ways]
    print_report(ways, tuned_us(args.summary), args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
