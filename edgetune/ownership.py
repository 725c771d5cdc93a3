"""Which directories edgetune may remove or replace: only those it created and marked.

A build writes into `<output>/<recipe>/`; a user may point `output:` anywhere, including at a
directory of their own. Every directory edgetune creates there gets a marker file, and nothing
without one is ever deleted, emptied or replaced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER_NAME = ".edgetune-owned"
"""Written into every directory edgetune creates and may later replace; left out of archives and manifests."""


def cache_dir() -> Path:
    """Where edgetune keeps what it downloads or builds once for many builds (runtime libraries, board root
    file systems, fleet state): $EDGETUNE_CACHE, else ~/.cache/edgetune."""
    return Path(os.environ.get("EDGETUNE_CACHE", Path.home() / ".cache" / "edgetune"))


def mark_owned(directory: Path) -> None:
    """Create `directory` (and parents) if needed and mark it as edgetune's."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / MARKER_NAME
    if not marker.exists():
        marker.write_text(json.dumps({"created_by": "edgetune"}) + "\n")


def create_owned(directory: Path) -> None:
    """Create `directory` with its missing parents, marking each one this call creates (and only those:
    an existing directory of the user's is used, never claimed)."""
    missing = []
    current = directory
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
        mark_owned(path)


def is_owned(directory: Path) -> bool:
    """True when edgetune created `directory` (it carries the marker)."""
    return (directory / MARKER_NAME).is_file() and not (directory / MARKER_NAME).is_symlink()


def foreign_directory_problem(directory: Path) -> str | None:
    """Why edgetune must not write into or replace `directory`, or None when it may.

    It may when the directory does not exist yet, is empty, or carries edgetune's marker.
    """
    if directory.is_symlink():
        return f"{directory}: is a symbolic link; edgetune writes only into directories it created"
    if not directory.exists():
        return None
    if not directory.is_dir():
        return f"{directory}: exists and is not a directory"
    if is_owned(directory) or not any(directory.iterdir()):
        return None
    return (f"{directory}: exists, is not empty and was not created by edgetune (no {MARKER_NAME} marker); "
            "edgetune never deletes or overwrites what it did not create: choose another output directory "
            "or move this one away")


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: a reader (or a build killed mid-write) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
