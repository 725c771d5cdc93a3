"""The same whole-model build in several variants, side by side: two checkouts of edgetune, or recipe settings.

    python benchmarks/variants.py --variant compared-4::in_model_candidates=4 --variant compared-1::in_model_candidates=1
    python benchmarks/variants.py --variant before:/tmp/edgetune-before --variant after:. --budget-min 5

A variant is NAME[:CHECKOUT[:KEY=VALUE,...]]: CHECKOUT is a source tree of edgetune to build with (left
empty: the installed one), KEY=VALUE are `tuning` settings of the recipe (integers, floats or words), or,
as `hardware.KEY=VALUE`, overrides of the host profile's hardware (`hardware.memory_bandwidth_gbs=40`).
Every variant builds the zoo model (or `--onnx FILE`, with `--input-shapes` for its symbolic dimensions)
for this machine (host profile, 2 cores) with draft-verify under the same budget, for each seed, the order
rotating, each as the `edgetune build` command in its own process with a fresh record store. Then all
artifacts and ONNX Runtime are timed interleaved on the idle machine.

Printed: per build, the seconds tuned, trials, the tuning time after which it first beat ONNX Runtime
(the build's own estimate), the final latency and its speed against ONNX Runtime's (round by round in the
process that timed it: `ArtifactTimes`); per variant, the median and range over seeds, and each variant's
median time against ONNX Runtime's over the first's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from busy_machine import time_artifacts  # noqa: E402  (through e2e: sets the thread counts first)
from models import onnx_model  # noqa: E402
from time_to_quality import build, recipe  # noqa: E402
from timing import ArtifactTimes, add_keep_option, build_directory  # noqa: E402


@dataclass
class Variant:
    name: str
    checkout: Path | None = None
    tuning: dict[str, Any] = field(default_factory=dict)
    hardware: dict[str, Any] = field(default_factory=dict)


def parse_variant(text: str) -> Variant:
    """NAME[:CHECKOUT[:KEY=VALUE,...]] (see the module doc)."""
    name, _, rest = text.partition(":")
    checkout, _, settings = rest.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"a variant needs a name: {text!r}")
    if checkout and not (Path(checkout) / "edgetune" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{checkout!r} is not a source tree of edgetune")
    tuning: dict[str, Any] = {}
    hardware: dict[str, Any] = {}
    for setting in filter(None, settings.split(",")):
        key, equals, value = setting.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {setting!r}")
        if key.startswith("hardware."):
            hardware[key.removeprefix("hardware.")] = _value(value)
        else:
            tuning[key] = _value(value)
    return Variant(name, Path(checkout) if checkout else None, tuning, hardware)


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    parser.add_argument("--model", choices=("resnet18", "mobilenet_v2"), default="resnet18")
    parser.add_argument("--onnx", type=Path, help="an ONNX file to build instead of the zoo model")
    parser.add_argument("--input-shapes", type=json.loads, default=None,
                        help='with --onnx: {"images": [1, 3, 224, 224]}')
    parser.add_argument("--budget-min", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds of the artifacts")
    add_keep_option(parser)
    args = parser.parse_args()
    if importlib.util.find_spec("edgetune") is None:
        raise SystemExit("edgetune is not installed for this Python: pip install -e . first")
    if len({v.name for v in args.variant}) != len(args.variant):
        raise SystemExit("variant names must differ")
    model_source = model_mapping(args)
    rows = []
    with build_directory(args.keep, "edgetune-variants-") as scratch:
        for turn, seed in enumerate(args.seeds):
            shift = turn % len(args.variant)
            for variant in args.variant[shift:] + args.variant[:shift]:
                run_dir = Path(scratch) / f"{variant.name}-{seed}"
                spec = recipe(args.model, args.budget_min, "draft-verify", seed, False, run_dir / "out")
                spec["model"] = model_source
                spec["tuning"].update(variant.tuning)
                host = next(t for t in spec["fleet"] if t["name"] == "host")
                host["overrides"]["hardware"].update(variant.hardware)
                print(f"seed {seed}: {variant.name}", flush=True)
                done = build(spec, "host", run_dir / "records", variant.checkout)
                rows.append({"variant": variant.name, "seed": seed, **done})
                print(f"    {done['latency_ms']:.2f} ms in the build's own timing; {done['trials_measured']} trials "
                      f"in {done['tuning_s']:.0f} s of tuning; build {done['build_wall_s']:.0f} s", flush=True)
        libraries = {f"{r['variant']}-{r['seed']}": Path(r["artifact_dir"]) / "model.so" for r in rows}
        print("timing every artifact and ONNX Runtime, interleaved", flush=True)
        times = time_artifacts(model_source, libraries, args.repeats)
    print_table(rows, times, args)
    return 0


def model_mapping(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's `model`: the ONNX file or the zoo model."""
    if args.onnx is None:
        return {"zoo": args.model}
    if not args.onnx.is_file():
        raise SystemExit(f"{args.onnx}: no such file")
    return onnx_model(args.onnx, args.input_shapes)


def print_table(rows: list[dict[str, Any]], times: ArtifactTimes, args: argparse.Namespace) -> None:
    """Per build: its latency and its speed against ONNX Runtime's beside it, round by round
    (`ArtifactTimes.vs_reference`); per variant the medians, and each variant against the first."""
    print(f"\n{args.onnx or args.model}, {args.budget_min} min budget, seeds {args.seeds}; ONNX Runtime "
          f"{times.reference_ms():.2f} ms")
    print("variant               seed  tuning s  trials  build s  beat ORT s  final ms  vs ORT")
    for r in rows:
        name = f"{r['variant']}-{r['seed']}"
        r["final_ms"], r["vs_ort"] = times.ms(name), times.vs_reference(name)
        beat = r.get("time_to_beat_reference_s")  # the build's own estimate, against its own ORT timing
        print(f"{r['variant']:20s}  {r['seed']:4d}  {r['tuning_s']:8.0f}  {r['trials_measured']:6d}  "
              f"{r['build_wall_s']:7.0f}  {'never' if beat is None else f'{beat:.0f}':>10s}  {r['final_ms']:8.2f}  "
              f"{r['vs_ort']:5.2f}x")
    for r in rows:
        name = f"{r['variant']}-{r['seed']}"
        split = times.vs_reference_by_placement(name)
        if len(split) > 1:
            print(f"  {name} against ONNX Runtime by the rounds' placement of the CPUs: "
                  + ", ".join(f"{label} {ratio:.2f}x ({count} rounds)" for label, (count, ratio) in split.items()))
    speeds = {}
    for variant in args.variant:
        mine = [r for r in rows if r["variant"] == variant.name]
        finals, speeds[variant.name] = [r["final_ms"] for r in mine], float(np.median([r["vs_ort"] for r in mine]))
        print(f"{variant.name}: median {np.median(finals):.2f} ms ({min(finals):.2f}-{max(finals):.2f}), "
              f"{speeds[variant.name]:.2f}x ONNX Runtime")
    first, *others = args.variant
    for other in others:
        print(f"median latency against ONNX Runtime's, {other.name} / {first.name}: "
              f"{speeds[first.name] / speeds[other.name]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
