"""Peak memory of a build: the whole process tree's resident size, against the bound 4x weights + 1 GB.

    python benchmarks/memory.py recipe.yaml
    python benchmarks/memory.py recipe.yaml --records-dir /tmp/fresh-records   # from scratch

Runs `edgetune build RECIPE` (the installed command, as a user would) and samples every 20 ms the
resident size of the build and of every process it starts (builder and runner workers, isolated library
loads, compilers). Prints each output line with the peak since the previous line, then the overall peak,
what each process held at that moment, the model's weights (its ONNX initializers) and the bound.

Two sums are kept. RSS counts a page once in every process that maps it: TVM's library (about 150 MB)
in each worker, and the whole parent once more in a worker's compiler child between fork and exec. PSS
shares each page out among the processes that map it, so the tree's sum is what the machine holds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

BOUND_FACTOR = 4
BOUND_BASE_BYTES = 1 << 30


class TreeSampler:
    """The summed RSS of a process and its descendants, sampled on a thread until the process ends."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.since_last = 0
        self.peak = 0
        self.peak_pss = 0
        self.at_peak: list[tuple[str, int, int]] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        root = psutil.Process(self.process.pid)
        while self.process.poll() is None:
            parts = _resident(root)
            total = sum(rss for _, rss, _ in parts)
            self.since_last = max(self.since_last, total)
            self.peak_pss = max(self.peak_pss, sum(pss for _, _, pss in parts))
            if total > self.peak:
                self.peak, self.at_peak = total, parts
            time.sleep(0.02)


def _resident(root: psutil.Process) -> list[tuple[str, int, int]]:
    """(command, RSS, PSS) of each process of the tree."""
    parts = []
    for process in [root, *root.children(recursive=True)]:
        try:
            memory = process.memory_full_info()
            parts.append((" ".join(process.cmdline()[:4])[:70], memory.rss, memory.pss))
        except psutil.Error:  # ended between the listing and the reading
            continue
    return parts


def weights_bytes(recipe_path: Path) -> int | None:
    """The model's initializers, in bytes (None for a torch.export program)."""
    from edgetune.frontend.onnx import load_model
    from edgetune.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    if recipe.model.exported_program is not None:
        return None
    loaded = load_model(zoo=recipe.model.zoo, onnx_path=recipe.model_path, input_shapes=recipe.model.input_shapes)
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for t in loaded.proto.graph.initializer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--records-dir", type=Path)
    args = parser.parse_args()
    command = ["edgetune", "build", str(args.recipe)]
    if args.records_dir:
        command += ["--records-dir", str(args.records_dir)]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(process)
    for line in process.stdout:
        print(f"{time.monotonic() - started:7.1f} s {sampler.since_last / 1e6:6.0f} MB | {line.rstrip()[:110]}",
              flush=True)
        sampler.since_last = 0
    process.wait()
    weights = weights_bytes(args.recipe)
    print(f"exit {process.returncode}; peak of the whole tree: RSS summed {sampler.peak / 1e9:.2f} GB, "
          f"PSS summed {sampler.peak_pss / 1e9:.2f} GB")
    print("  at the RSS peak:     RSS      PSS")
    for name, rss, pss in sorted(sampler.at_peak, key=lambda part: -part[1]):
        print(f"  {rss / 1e6:20.0f} MB {pss / 1e6:5.0f} MB  {name}")
    if weights is not None:
        bound = BOUND_FACTOR * weights + BOUND_BASE_BYTES
        verdicts = ", ".join(f"{name} {'within' if peak <= bound else 'over'}"
                             for name, peak in (("RSS", sampler.peak), ("PSS", sampler.peak_pss)))
        print(f"weights {weights / 1e6:.1f} MB; bound {BOUND_FACTOR}x + 1 GiB = {bound / 1e9:.2f} GB: {verdicts}")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
