"""The deployable artifact: a directory, and the same as a reproducible `<target>.tar.gz`.

Layout: the library; `run.py`, `README.md` and the C++ deploy program's sources (`deploy/`)
rendered from templates; a sample input with ONNX Runtime's output for it; optionally TVM's
runtime for the device (`runtime/`) and the deploy program built against it (`bin/deploy`); and
`manifest.json` carrying the sha256 of every other file.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

LIBRARY_NAME = "model.so"
MANIFEST_NAME = "manifest.json"
SAMPLE_INPUT_NAME = "sample_input.npz"
REFERENCE_OUTPUT_NAME = "reference_output.npz"

_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("edgetune.package", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz whose bytes depend only on the arrays (np.savez stamps zip entries with the time)."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(info, buffer.getvalue())


_TEMPLATES_OUT = {
    "run.py.j2": "run.py",
    "README.md.j2": "README.md",
    "deploy.cc.j2": "deploy/deploy.cc",
    "CMakeLists.txt.j2": "deploy/CMakeLists.txt",
}


def write_artifact_files(
    directory: Path,
    *,
    library: Path,
    sample_inputs: dict[str, np.ndarray],
    reference_outputs: dict[str, np.ndarray],
    template_context: dict[str, Any],
) -> None:
    """Fill `directory` (emptied first) with everything but the manifest, which comes last."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    shutil.copyfile(library, directory / LIBRARY_NAME)
    save_arrays(directory / SAMPLE_INPUT_NAME, sample_inputs)
    save_arrays(directory / REFERENCE_OUTPUT_NAME, reference_outputs)
    context = {**template_context, "library": LIBRARY_NAME}
    for template, name in _TEMPLATES_OUT.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_TEMPLATES.get_template(template).render(**context))
    (directory / "run.py").chmod(0o755)


def artifact_files(directory: Path) -> list[Path]:
    """Every file of the artifact but the manifest, as paths relative to it, sorted."""
    return sorted(p.relative_to(directory) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    """`manifest.json` with a `files` entry: the sha256 of every other file of the artifact."""
    files = {str(p): sha256_file(directory / p) for p in artifact_files(directory)}
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps({**manifest, "files": files}, indent=2, sort_keys=True) + "\n")
    return path


