"""Reproducible .tar.gz files: artifacts and exported tuning records must be byte-identical when
their files are, so release pipelines can compare and cache them by checksum."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import tarfile
import zlib
from pathlib import Path, PurePosixPath

from edgetune.errors import InputError
from edgetune.ownership import MARKER_NAME


def archive_directory(directory: Path, archive: Path) -> Path:
    """`<name>.tar.gz` of the directory with sorted entries, fixed times and owners: same files, same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        # edgetune's ownership marker says who may replace this directory here; it is not part of what ships
        for path in [directory, *sorted(p for p in directory.rglob("*") if p != directory / MARKER_NAME)]:
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


MAX_MEMBERS = 10_000
"""More entries than any artifact or records export has; a tar of millions of empty files exhausts inodes."""
MAX_EXPANDED_BYTES = 4 << 30
"""A ResNet-50 artifact with its runtime expands to a few hundred MB; 4 GiB leaves room and refuses a bomb."""
_FREE_SPACE_MARGIN = 256 << 20


def safe_extract(archive: Path, into: Path, *, max_members: int = MAX_MEMBERS,
                 max_bytes: int = MAX_EXPANDED_BYTES) -> None:
    """Unpack a .tar.gz nobody vouches for into `into`, an empty directory edgetune owns.

    Every header is read and checked before one byte is written: at most `max_members` entries,
    at most `max_bytes` once expanded (and that much free disk space), only regular files and
    directories, each a relative path that stays inside. Anything else is an InputError naming the
    archive and the member, so a bomb, a link or a `../` path never reaches the disk."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _checked_members(archive, tar, max_members, max_bytes)
            free = shutil.disk_usage(into).free
            expanded = sum(m.size for m in members)
            if expanded + _FREE_SPACE_MARGIN > free:
                raise InputError(f"{archive}: expands to {expanded / 1e6:.1f} MB but {into} has only "
                                 f"{free / 1e6:.1f} MB free")
            for member in members:
                tar.extract(member, into, filter="data")
    except (EOFError, zlib.error, gzip.BadGzipFile, tarfile.TarError) as exc:
        raise InputError(f"{archive}: not a readable .tar.gz: truncated or damaged ({exc or type(exc).__name__})") \
            from exc
    except OSError as exc:
        raise InputError(f"{archive}: cannot be read or unpacked: {exc}") from exc


def _checked_members(archive: Path, tar: tarfile.TarFile, max_members: int, max_bytes: int
                     ) -> list[tarfile.TarInfo]:
    """The archive's entries, read header by header so a bomb is refused before its end is reached."""
    members = []
    expanded = 0
    for member in tar:
        members.append(member)
        if len(members) > max_members:
            raise InputError(f"{archive}: more than {max_members} entries; refused (not an edgetune archive)")
        where = f"{archive}: member {member.name!r}"
        if not (member.isfile() or member.isdir()):
            kind = "a link" if member.issym() or member.islnk() else "a device or special file"
            raise InputError(f"{where} is {kind}; an edgetune archive holds only files and directories")
        parts = PurePosixPath(member.name).parts
        if member.name.startswith(("/", "\\")) or ".." in parts or not parts or ":" in parts[0]:
            raise InputError(f"{where}: absolute path or '..'; every member must stay inside the archive's directory")
        expanded += member.size
        if expanded > max_bytes:
            raise InputError(f"{archive}: expands to more than {max_bytes / 1e6:.0f} MB; refused (an archive bomb?)")
    return members
