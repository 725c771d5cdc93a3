"""The in-model comparison's choice against the tuner's best, each model timed in turns.

    python benchmarks/selection.py recipes/host.yaml --records-dir /tmp/records --repeats 3

Reads a built recipe's first target (its model, profile and record store; `--records-dir` as given to
`edgetune build`), then `--repeats` times: compares each kernel's `--candidates` best schedules and its
default inside the model (edgetune/selection.py, as the build does) and compiles the chosen records. Each
choice and the model with every kernel's tuner-best schedule are then timed in interleaved rounds (the
order reversed every other round) and printed as ratios to the tuner's best: below 1.00 the comparison
chose faster schedules, above it its choice cost speed. Where the repeats disagree, the comparison is
deciding on noise. Each comparison's whole-model check (its choice timed whole in turns with the tuner's
best; kept below 1.000) is printed beside it, with its seconds and the models it compiled and timed (the tuner's
best, the default schedules', each rank's). `--seconds S` gives each comparison S seconds, as a build's budget
gives it its share (the default schedules' model then compiled inside it, which a build compiles apart): how
many ranks fit. The record store is only read.

    python benchmarks/selection.py recipe.yaml --records-dir DIR --repeats 1 --seconds 68
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved_rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--records-dir", type=Path, default=None)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="comparisons run, each timed against the best")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    parser.add_argument("--seconds", type=float, default=None, help="each comparison's time, as a budget's share")
    args = parser.parse_args(argv)

    import tvm
    from tvm import relax

    from edgetune.compile import compile_model, export_library
    from edgetune.frontend.onnx import load_model, to_relax
    from edgetune.frontend.winograd import WinogradPolicy
    from edgetune.pipeline import record_locations
    from edgetune.profiles import resolve_profile
    from edgetune.recipe import load_recipe
    from edgetune.runtime import use_cpu_threads
    from edgetune.selection import select_schedules
    from edgetune.tuning.database.store import RecordStore

    recipe = load_recipe(args.recipe)
    target = recipe.fleet[0]
    profile = resolve_profile(target.profile, target.overrides)
    store = RecordStore(record_locations(recipe, [target.name], args.records_dir)[target.name].directory)
    model = load_model(zoo=recipe.model.zoo, onnx_path=recipe.model_path, input_shapes=recipe.model.input_shapes,
                       exported_program=recipe.exported_program_path)
    relax_mod, tvm_target = to_relax(model), profile.tvm_target()
    hardware = profile.hardware
    winograd = WinogradPolicy(hardware.peak_gflops, hardware.memory_bandwidth_gbs) if recipe.tuning.winograd else None
    use_cpu_threads(profile.cpu_threads or 1)
    device = tvm.cpu(0)
    samples = model.sample_inputs()
    inputs = [samples[i.name] for i in model.inputs]
    work = Path(tempfile.mkdtemp(prefix="edgetune-selection-"))

    libraries = {"tuner's best": export_library(compile_model(relax_mod, tvm_target, store.database, winograd),
                                                work / "best.so")}
    for repeat in range(args.repeats):
        started = time.monotonic()
        compiled = work / f"comparison{repeat + 1}"  # as the build compiles them: libraries, loaded to run
        compiled.mkdir()
        deadline = started + args.seconds if args.seconds is not None else None
        chosen = select_schedules(relax_mod, tvm_target, store.database, inputs, device, args.candidates, winograd,
                                  deadline=deadline, libraries=compiled)
        ranks = sorted(choice.rank for choice in chosen.choices.values())
        verified = "-" if chosen.verified_ratio is None else f"{chosen.verified_ratio:.3f}"
        cut = ", stopped by its seconds" if chosen.stopped_by_deadline else ""
        print(f"comparison {repeat + 1}: {time.monotonic() - started:.1f} s, {chosen.models_compiled} models "
              f"timed{cut}, ranks chosen {ranks}, whole-model check {verified}", flush=True)
        if chosen.library is None:
            raise SystemExit("the store holds no records of this model's kernels: nothing to compare")
        libraries[f"comparison {repeat + 1}"] = chosen.library

    arguments = [tvm.runtime.tensor(x, device) for x in inputs]
    machines = {name: relax.VirtualMachine(tvm.runtime.load_module(str(path)), device)
                for name, path in libraries.items()}
    runners = {name: (lambda vm=vm: vm["main"](*arguments)) for name, vm in machines.items()}
    rounds, _ = interleaved_rounds(runners, args.rounds, min_s=0.3, min_calls=5)
    best_ms = float(np.median(rounds["tuner's best"])) * 1e3
    print(f"{'model':<16} {'median ms':>10} {'vs best':>8}  rounds (ms)")
    for name, seconds in rounds.items():
        median_ms = float(np.median(seconds)) * 1e3
        spread = " ".join(f"{s * 1e3:.2f}" for s in seconds)
        print(f"{name:<16} {median_ms:>10.3f} {median_ms / best_ms:>8.3f}  {spread}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
