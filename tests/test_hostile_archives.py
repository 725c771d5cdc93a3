"""`edgetune verify` and `records import` on archives built to hurt: each is refused with a clear
message naming the archive and member, exit 2 (bad input) or 1 (not verified), no traceback, and
nothing is written outside the verifier's own scratch directory."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import uuid
from pathlib import Path

import pytest
from conftest import run_edgetune, write_tiny_recipe
from test_artifact import make_artifact

from edgetune.archive import archive_directory, safe_extract
from edgetune.errors import InputError
from edgetune.package.artifact import write_manifest


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


def _verify(archive: Path, cwd: Path) -> tuple[int, str]:
    run = run_edgetune("verify", str(archive), cwd=cwd, timeout=120)
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert "Aborted" not in run.stderr
    return run.returncode, run.stderr


def test_a_declared_huge_member_is_refused_before_anything_is_extracted(tmp_path: Path) -> None:
    archive = tmp_path / "bomb.tar.gz"
    header = _entry("host/model.so")
    header.size = 5 << 30  # the header promises 5 GiB; the 2 MB of zeros after it compress to almost nothing
    raw = header.tobuf(format=tarfile.PAX_FORMAT) + bytes(2 << 20)
    archive.write_bytes(gzip.compress(raw, compresslevel=1))
    code, stderr = _verify(archive, tmp_path)
    assert code == 2 and "bomb.tar.gz: expands to more than" in stderr


def test_a_real_bomb_is_refused_by_its_expanded_size_and_nothing_lands(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "zeros.tar.gz", [(_entry("top"), None), (_entry("top/zeros"), bytes(50 << 20))])
    assert archive.stat().st_size < 200_000
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(InputError, match="expands to more than 10 MB"):
        safe_extract(archive, into, max_bytes=10_000_000)
    assert list(into.iterdir()) == []


def test_too_many_members_are_refused(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "many.tar.gz", [(_entry(f"host/f{i}"), b"") for i in range(10_001)])
    code, stderr = _verify(archive, tmp_path)
    assert code == 2 and "more than 10000 entries" in stderr


@pytest.mark.parametrize("entry, expected", [
    (lambda name: _entry(f"../{name}"), "absolute path or '..'"),
    (lambda name: _entry(f"/tmp/{name}"), "absolute path or '..'"),
    (lambda name: _entry("host/link", tarfile.SYMTYPE, f"/tmp/{name}"), "is a link"),
    (lambda name: _entry("host/hard", tarfile.LNKTYPE, "/etc/passwd"), "is a link"),
    (lambda name: _entry("host/dev", tarfile.CHRTYPE), "a device or special file"),
], ids=["dotdot", "absolute", "symlink", "hardlink", "device"])
def test_unsafe_members_are_refused_and_nothing_is_written(tmp_path: Path, entry, expected: str) -> None:
    name = f"edgetune-hostile-{uuid.uuid4().hex}"
    member = entry(name)
    archive = _tar(tmp_path / "evil.tar.gz", [(_entry("host", tarfile.DIRTYPE), None),
                                             (member, b"owned" if member.isfile() else None)])
    code, stderr = _verify(archive, tmp_path)
    assert code == 2 and "evil.tar.gz: member" in stderr and expected in stderr, stderr
    assert not (Path("/tmp") / name).exists() and not (tmp_path.parent / name).exists()


def test_garbage_and_a_truncated_archive_are_named_not_aborted(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"\x00not an archive at all" * 100)
    code, stderr = _verify(garbage, tmp_path)
    assert code == 2 and "garbage.tar.gz: not a readable .tar.gz" in stderr
    whole = archive_directory(make_artifact(tmp_path / "a"), tmp_path / "whole.tar.gz").read_bytes()
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    code, stderr = _verify(truncated, tmp_path)
    assert code == 2 and "truncated.tar.gz: not a readable .tar.gz: truncated or damaged" in stderr


def _artifact_archive(tmp_path: Path, manifest_text: str) -> Path:
    directory = make_artifact(tmp_path / "src")
    (directory / "manifest.json").write_text(manifest_text)
    return archive_directory(directory, tmp_path / "host.tar.gz")


def test_a_manifest_that_is_a_list_or_lacks_fields_is_named(tmp_path: Path) -> None:
    code, stderr = _verify(_artifact_archive(tmp_path / "list", "[1, 2]\n"), tmp_path)
    assert code == 2 and "host/manifest.json: expected a JSON object, found a list" in stderr
    code, stderr = _verify(_artifact_archive(tmp_path / "fields", json.dumps({"files": {}, "target": {}})), tmp_path)
    assert code == 2
    for missing in ("target.device: missing", "target.arch: missing", "model: missing", "verification: missing"):
        assert missing in stderr


def test_a_manifest_entry_outside_the_artifact_is_an_error(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path / "src")
    manifest = {"target": {"device": "cpu", "arch": "x86_64"}, "model": {"inputs": [{"name": "data"}],
                "outputs": ["logits"]}, "verification": {"rtol": 1e-4, "atol": 1e-4}}
    write_manifest(directory, manifest)
    listed = json.loads((directory / "manifest.json").read_text())
    listed["files"]["../../etc/passwd"] = "0" * 64
    (directory / "manifest.json").write_text(json.dumps(listed))
    for target in (directory, archive_directory(directory, tmp_path / "host.tar.gz")):
        code, stderr = _verify(target, tmp_path)
        assert code == 2 and "files['../../etc/passwd']: points outside the artifact" in stderr


def test_a_listed_symlink_in_an_artifact_directory_is_refused(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path / "src")
    manifest = {"target": {"device": "cpu", "arch": "x86_64"}, "model": {"inputs": [{"name": "data"}],
                "outputs": ["logits"]}, "verification": {"rtol": 1e-4, "atol": 1e-4}}
    (directory / "README.md").unlink()
    (directory / "README.md").symlink_to("/etc/hostname")
    write_manifest(directory, manifest)
    code, stderr = _verify(directory, tmp_path)
    assert code == 2 and "README.md: a symbolic link" in stderr


def test_a_records_archive_with_a_link_imports_nothing(tmp_path: Path) -> None:
    recipe = write_tiny_recipe(tmp_path)
    archive = _tar(tmp_path / "records.tar.gz", [(_entry("edgetune-records", tarfile.DIRTYPE), None),
                                                (_entry("edgetune-records/index.json", tarfile.SYMTYPE, "/etc"), None)])
    run = run_edgetune("records", "import", str(recipe), str(archive), cwd=tmp_path, timeout=120)
    assert run.returncode == 2 and "is a link" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_tracker_bound_beyond_loopback_is_warned(tmp_path: Path) -> None:
    """TVM's RPC has no authentication: `fleet up` says so whenever it binds a non-loopback address."""
    import socket

    from edgetune.fleet import tracker

    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        directory = tmp_path / host
        directory.mkdir()
        recipe = write_tiny_recipe(directory)
        recipe.write_text(recipe.read_text() + f"tracker: {{host: {host}, port: {port}, start: true}}\n")
        try:
            up = run_edgetune("fleet", "up", "tiny.yaml", cwd=directory, timeout=120)
        finally:
            tracker.stop(directory / "out" / "tiny" / "fleet")  # the one this test started, by its pid file
        assert up.returncode == 0, up.stderr
        assert (f"warning: the RPC tracker listens on {host}, not loopback" in up.stdout) is warned, up.stdout
        assert ("no authentication" in up.stdout) is warned


def test_a_library_that_exits_when_loaded_cannot_fake_a_pass(tmp_path: Path) -> None:
    """The artifact's code runs in a child process: a library whose constructor ends the process with
    status 0 would end an in-process verifier "successfully"; here it only fails the child."""
    import shutil
    import subprocess

    from edgetune.profiles import machine_isa

    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    source = tmp_path / "exit.c"
    source.write_text("#include <unistd.h>\n__attribute__((constructor)) static void leave(void) { _exit(0); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "exit.so"), str(source)], check=True)
    directory = make_artifact(tmp_path / "src", (tmp_path / "exit.so").read_bytes())
    write_manifest(directory, {"target": {"device": "cpu", "arch": machine_isa()},
                               "model": {"inputs": [{"name": "data"}], "outputs": ["logits"]},
                               "verification": {"rtol": 1e-4, "atol": 1e-4}})
    code, stderr = _verify(archive_directory(directory, tmp_path / "host.tar.gz"), tmp_path)
    assert code == 1 and "host/model.so: running the model failed" in stderr
