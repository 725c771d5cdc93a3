"""Reproducible .tar.gz files: artifacts and exported tuning records must be byte-identical when
their files are, so release pipelines can compare and cache them by checksum."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path


def archive_directory(directory: Path, archive: Path) -> Path:
    """`<name>.tar.gz` of the directory with sorted entries, fixed times and owners: same files, same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in [directory, *sorted(directory.rglob("*"))]:
            info = tar.gettarinfo(str(path), arcname=str(Path(directory.name) / path.relative_to(directory)))
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644
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
