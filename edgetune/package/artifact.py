"""The deployable artifact: a directory, and the same as a reproducible `<target>.tar.gz`.

Layout: the library; `io.json`, the model's input and output names as data; `run.py`, `README.md`
and the C++ deploy program's sources (`deploy/`) rendered from templates, none holding a name; a
sample input with ONNX Runtime's output for it; optionally TVM's runtime for the device
(`runtime/`) and the deploy program built against it (`bin/deploy`); and `manifest.json` carrying
the sha256 of every other file. The directory carries edgetune's ownership marker, which is in
neither the manifest nor the archive.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from edgetune.errors import InputError
from edgetune.ownership import MARKER_NAME, foreign_directory_problem, mark_owned
from edgetune.package.escaping import code_value, excerpt_for_error, markdown_text
from edgetune.package.manifest import Manifest, manifest_text
from edgetune.thread_pool import POOL_LIBRARY_NAME

LIBRARY_NAME = "model.so"
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
"""Ed25519 signature of manifest.json's exact bytes (`build --sign-key`); not listed in the manifest."""
SAMPLE_INPUT_NAME = "sample_input.npz"
REFERENCE_OUTPUT_NAME = "reference_output.npz"

IO_NAME = "io.json"
"""The model's input and output names, shapes and dtypes, the device and the tolerances: what run.py
reads at run time, so that no name is ever part of generated code."""


def _environment(finalize: Callable[[Any], Any]) -> jinja2.Environment:
    """Templates whose every printed value goes through `finalize`: escaping is not left to each template."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("edgetune.package", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        finalize=finalize,
    )


_CODE_TEMPLATES = _environment(code_value)
_MARKDOWN_TEMPLATES = _environment(markdown_text)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An .npz whose bytes depend only on the arrays (np.savez stamps zip entries with the time)."""
    import zipfile

    unstorable = [excerpt_for_error(name) for name in sorted(arrays) if "\x00" in name]
    if unstorable:  # zipfile would cut the member's name there, and the array would be lost under another name
        raise InputError(f"model input or output {', '.join(unstorable)}: a name with a NUL character cannot be "
                         "stored in an .npz (a zip member's name ends at NUL); rename it in the ONNX model")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(info, buffer.getvalue())


_TEMPLATES_OUT = {
    "run.py.j2": ("run.py", _CODE_TEMPLATES),
    "README.md.j2": ("README.md", _MARKDOWN_TEMPLATES),
    "deploy.cc.j2": ("deploy/deploy.cc", _CODE_TEMPLATES),
    "CMakeLists.txt.j2": ("deploy/CMakeLists.txt", _CODE_TEMPLATES),
}


def write_artifact_files(directory: Path, **contents: Any) -> None:
    """Everything but the manifest written beside `directory`, then swapped in; `contents` as `stage_artifact`
    takes them."""
    staging = stage_artifact(directory, **contents)
    try:
        replace_owned_directory(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def stage_artifact(
    directory: Path,
    *,
    library: Path,
    sample_inputs: dict[str, np.ndarray],
    reference_outputs: dict[str, np.ndarray],
    template_context: dict[str, Any],
    thread_pool: Path | None = None,
) -> Path:
    """A marked sibling of `directory` holding everything but the manifest; the build completes it (runtime,
    manifest, signature) and only then puts it in place with `replace_owned_directory`, so the final name
    never holds a half-written artifact.

    An existing `directory` is replaced only when edgetune made it (it carries the ownership marker);
    anything else is an InputError naming it, with nothing touched."""
    with owned_staging_beside(directory) as staging:
        staging.chmod(0o755)
        _fill_artifact(staging, library, sample_inputs, reference_outputs,
                       {**template_context, "thread_pool": thread_pool})
    return staging


def _fill_artifact(directory: Path, library: Path, sample_inputs: dict[str, np.ndarray],
                   reference_outputs: dict[str, np.ndarray], template_context: dict[str, Any]) -> None:
    shutil.copyfile(library, directory / LIBRARY_NAME)
    if template_context["thread_pool"] is not None:  # edgetune's thread pool, where its threads wait in it
        shutil.copyfile(template_context["thread_pool"], directory / POOL_LIBRARY_NAME)
    save_arrays(directory / SAMPLE_INPUT_NAME, sample_inputs)
    save_arrays(directory / REFERENCE_OUTPUT_NAME, reference_outputs)
    (directory / IO_NAME).write_text(json.dumps(_io_spec(template_context, sample_inputs), indent=2) + "\n")
    context = {**template_context, "library": LIBRARY_NAME}
    for template, (name, environment) in _TEMPLATES_OUT.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(environment.get_template(template).render(**context))
    (directory / "run.py").chmod(0o755)


def _io_spec(context: dict[str, Any], sample_inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """io.json's content: names as JSON strings (ASCII, every character escaped as JSON escapes it)."""
    return {
        "model": context["model_name"],
        "target": context["target_name"],
        "device": context["device"],
        "library": LIBRARY_NAME,
        "cpu_threads": context["cpu_threads"],
        "cpu_thread_spin_count": context["cpu_thread_spin_count"],
        "cpu_thread_pool": POOL_LIBRARY_NAME if context["thread_pool"] is not None else None,
        "rtol": context["rtol"],
        "atol": context["atol"],
        # index_limit: the rows of the table an integer input indexes (a token embedding), else null;
        # index_from: the lowest id the model reads a row for (-index_limit: counted from the end; or 0)
        "inputs": [{"name": i["name"], "shape": [int(d) for d in i["shape"]],
                    "dtype": str(sample_inputs[i["name"]].dtype), "index_limit": i["index_limit"],
                    "index_from": i["index_from"]}
                   for i in context["inputs"]],
        "outputs": [{"name": name} for name in context["output_names"]],
    }


def refuse_foreign(directory: Path) -> None:
    """InputError naming `directory` unless edgetune may replace it (absent, empty, or marked as its own)."""
    problem = foreign_directory_problem(directory)
    if problem is not None:
        raise InputError(problem)


@contextmanager
def owned_staging_beside(directory: Path) -> Iterator[Path]:
    """A fresh, marked sibling of `directory` to fill and then put in place with `replace_owned_directory`, removed
    if the block raises; an InputError naming `directory` first when it exists and is not edgetune's."""
    refuse_foreign(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.new-", dir=directory.parent))
    try:
        mark_owned(staging)
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_owned_directory(new: Path, directory: Path) -> None:
    """Put `new` (a sibling) in place of `directory`: the old one is renamed away before it is removed,
    so at no point is a half-written directory under the final name."""
    if not directory.exists():
        new.rename(directory)
        return
    refuse_foreign(directory)
    old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
    directory.rename(old)  # onto the empty directory just made: rename(2) replaces an empty one
    new.rename(directory)
    shutil.rmtree(old)


def claim_build_directory(build_dir: Path, target_names: list[str]) -> None:
    """Before a build writes anything: an InputError naming every path when the build directory or a
    target's artifact directory exists and is not edgetune's; else mark the directories it will create."""
    problems = [p for p in map(foreign_directory_problem, [build_dir, *(build_dir / n for n in target_names)]) if p]
    if problems:
        raise InputError(problems)
    mark_owned(build_dir)
    work = build_dir / "work"
    for path in (work, *(work / name for name in target_names)):
        if foreign_directory_problem(path) is None:  # never deleted, but not claimed when someone else's
            mark_owned(path)


def artifact_files(directory: Path) -> list[Path]:
    """Every file of the artifact but the manifest, its signature and edgetune's ownership marker, as paths
    relative to it, sorted."""
    unlisted = {Path(MANIFEST_NAME), Path(SIGNATURE_NAME), Path(MARKER_NAME)}
    return sorted(p.relative_to(directory) for p in directory.rglob("*")
                  if p.is_file() and p.relative_to(directory) not in unlisted)


def write_manifest(directory: Path, manifest: Manifest | Mapping[str, Any]) -> Path:
    """`manifest.json` with its `files`: the sha256 of every other file of the artifact. `manifest` is the
    build's Manifest, or any JSON object (a partial or altered manifest, as a test or a tool makes one)."""
    files = {str(p): sha256_file(directory / p) for p in artifact_files(directory)}
    path = directory / MANIFEST_NAME
    if isinstance(manifest, Manifest):
        path.write_text(manifest.model_copy(update={"files": files}).text())
    else:
        path.write_text(manifest_text({**manifest, "files": files}))
    return path


