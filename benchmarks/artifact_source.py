"""A built artifact and the model it was built from, as the benchmarks that time an artifact take them.

`layers.py`, `contention.py` and `overhead.py` read the same options, load the model the same way, and the
last two pass the options on to a child process of their own as they were given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgetune.frontend.onnx import LoadedModel


def add_artifact_source(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The artifact directory and, required, the zoo model or ONNX file (with its input shapes) it was built from."""
    parser.add_argument("artifact", type=Path, help="a build's artifact directory (the one holding model.so)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="the zoo model the artifact was built from")
    source.add_argument("--onnx", type=Path, help="the ONNX file the artifact was built from")
    parser.add_argument("--input-shapes", help='e.g. {"x": [1, 3, 224, 224]}')
    return parser


def checked_artifact(args: argparse.Namespace) -> Path:
    """The artifact's model.so; exits naming the directory when it holds none."""
    library = args.artifact / "model.so"
    if not library.is_file():
        raise SystemExit(f"{args.artifact}: no model.so (give the artifact directory of a build)")
    return library


def load_source_model(args: argparse.Namespace) -> LoadedModel:
    """The model the options name, loaded as the build loaded it."""
    from edgetune.frontend.onnx import load_model

    try:
        shapes = json.loads(args.input_shapes) if args.input_shapes else None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--input-shapes: not JSON ({exc}); e.g. {{\"x\": [1, 3, 224, 224]}}") from None
    return load_model(zoo=args.model, onnx_path=args.onnx, input_shapes=shapes)


def source_argv(args: argparse.Namespace) -> list[str]:
    """The options as a child process's command line takes them back (`add_artifact_source`)."""
    argv = [str(args.artifact), *(["--model", args.model] if args.model else ["--onnx", str(args.onnx)])]
    return argv + (["--input-shapes", args.input_shapes] if args.input_shapes else [])
