"""The deployable artifact: a directory, and the same as a reproducible `<target>.tar.gz`.

Layout: the library, `run.py` and `README.md` rendered from templates, a sample input with ONNX
Runtime's output for it, and `manifest.json` carrying the sha256 of every other file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
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


def write_artifact(
    directory: Path,
    *,
    library: Path,
    sample_inputs: dict[str, np.ndarray],
    reference_outputs: dict[str, np.ndarray],
    manifest: dict[str, Any],
    template_context: dict[str, Any],
) -> Path:
    """Fill `directory` (emptied first) and return the manifest's path.

    `manifest` gets a `files` entry with the sha256 of every file written beside it.
    """
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    shutil.copyfile(library, directory / LIBRARY_NAME)
    save_arrays(directory / SAMPLE_INPUT_NAME, sample_inputs)
    save_arrays(directory / REFERENCE_OUTPUT_NAME, reference_outputs)
    context = {**template_context, "library": LIBRARY_NAME}
    for template, name in (("run.py.j2", "run.py"), ("README.md.j2", "README.md")):
        (directory / name).write_text(_TEMPLATES.get_template(template).render(**context))
    (directory / "run.py").chmod(0o755)
    files = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}
    manifest_path = directory / MANIFEST_NAME
    manifest_path.write_text(json.dumps({**manifest, "files": files}, indent=2, sort_keys=True) + "\n")
    return manifest_path


def archive_artifact(directory: Path, archive: Path) -> Path:
    """`<name>.tar.gz` of the directory with sorted entries, fixed times and owners: same files, same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in [directory, *sorted(directory.rglob("*"))]:
            info = tar.gettarinfo(str(path), arcname=str(Path(directory.name) / path.relative_to(directory)))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if path.is_dir() or path.name == "run.py" else 0o644
            info.pax_headers = {}
            if path.is_file():
                with path.open("rb") as stream:
                    tar.addfile(info, stream)
            else:
                tar.addfile(info)
    tmp = archive.with_suffix(".tmp")
    with tmp.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(buffer.getvalue())
    tmp.replace(archive)
    return archive
