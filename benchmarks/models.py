"""Real networks end to end: build each ONNX file for this machine under a tuning budget and compare.

    python benchmarks/models.py model_a.onnx model_b.onnx --budget-min 10
    python benchmarks/models.py bert.onnx --input-shapes '{"input_ids": [1, 128]}' --json out.json

Each file is built with `edgetune.pipeline.build` (host profile, draft-verify search unless `--search`
says otherwise, `--budget-min` minutes of tuning per model), verified against ONNX Runtime, and timed
tuned, untuned and in ONNX Runtime with the same thread count. The table gives the three latencies,
the speedup of tuning (untuned / tuned) and the ratio to ONNX Runtime (ORT / tuned: above 1 is faster
than ONNX Runtime). A model that fails to build is listed with edgetune's error and the others go on.
The recipe is written as data (JSON, which YAML reads), so no file name becomes recipe syntax.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def onnx_model(model_path: Path, input_shapes: dict[str, list[int]] | None) -> dict[str, Any]:
    """A recipe's `model` for an ONNX file: its absolute path (builds may run in other directories)."""
    model: dict[str, Any] = {"onnx": str(model_path.resolve())}
    if input_shapes:
        model["input_shapes"] = input_shapes
    return model


def recipe_for(model_path: Path, name: str, budget_min: float, search: str, output: Path,
               input_shapes: dict[str, list[int]] | None) -> dict[str, Any]:
    """A one-target recipe for this machine: the budget, not a trial count, ends the tuning."""
    return {
        "name": name,
        "model": onnx_model(model_path, input_shapes),
        "fleet": [{"name": "host", "profile": "host"}],
        "tuning": {"trials_per_task": 100_000, "time_budget_min": budget_min, "search": search},
        "output": str(output.resolve()),
    }


def recipe_name(path: Path, taken: set[str]) -> str:
    """A recipe name (lowercase letters, digits, '-', '_') derived from the file name, unique in this run."""
    base = re.sub(r"[^a-z0-9_-]+", "-", path.stem.lower()).strip("-_") or "model"
    name, index = base, 2
    while name in taken:
        name, index = f"{base}-{index}", index + 1
    taken.add(name)
    return name


def build_one(recipe: dict[str, Any], quiet: bool) -> dict[str, Any]:
    """Build with the real pipeline; the host target's latencies, verification and error."""
    from edgetune.errors import EdgetuneError
    from edgetune.pipeline import build
    from edgetune.recipe import load_recipe_text

    def on_event(event) -> None:
        if not quiet and event.message:
            print(f"  [{recipe['name']}:{event.target}] {event.message}", flush=True)

    try:
        result = build(load_recipe_text(json.dumps(recipe), f"{recipe['name']} (benchmarks/models.py)", REPO),
                       on_event=on_event)
    except EdgetuneError as exc:
        return {"error": str(exc)}
    host = result.targets["host"]
    return {"tuned_ms": host.latency_ms, "untuned_ms": host.untuned_latency_ms,
            "onnxruntime_ms": host.reference_latency_ms, "verified": host.verified, "error": host.error,
            "trials": host.trials_measured, "tuning_s": host.tuning_s}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    def ms(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else "-"

    def times(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else "-"

    header = f"{'model':<28} {'tuned ms':>10} {'untuned ms':>11} {'ORT ms':>10} {'untuned/tuned':>14} " \
             f"{'ORT/tuned':>10} {'verified':>9}"
    print(header)
    print("-" * len(header))
    for name, row in rows.items():
        if row.get("error"):
            print(f"{name:<28} failed: {row['error']}")
            continue
        print(f"{name:<28} {ms(row['tuned_ms']):>10} {ms(row['untuned_ms']):>11} {ms(row['onnxruntime_ms']):>10} "
              f"{times(ratio(row['untuned_ms'], row['tuned_ms'])):>14} "
              f"{times(ratio(row['onnxruntime_ms'], row['tuned_ms'])):>10} {'yes' if row['verified'] else 'no':>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path, help="ONNX files")
    parser.add_argument("--budget-min", type=float, default=5.0, help="tuning minutes per model (default 5)")
    parser.add_argument("--search", choices=["draft-verify", "evolutionary"], default="draft-verify")
    parser.add_argument("--input-shapes", type=json.loads, default=None,
                        help='JSON object of input name -> shape, for models with symbolic dimensions')
    parser.add_argument("--output", type=Path, default=REPO / "build" / "bench-models")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quiet", action="store_true", help="no build progress lines")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.models if not p.is_file()]
    if missing:
        parser.error(f"not a file: {', '.join(missing)}")
    rows: dict[str, dict[str, Any]] = {}
    taken: set[str] = set()
    for path in args.models:
        name = recipe_name(path, taken)
        print(f"building {path} as '{name}' ({args.budget_min} min, {args.search})", flush=True)
        recipe = recipe_for(path, name, args.budget_min, args.search, args.output, args.input_shapes)
        rows[name] = {"file": str(path), **build_one(recipe, args.quiet)}
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(not row.get("error") for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
