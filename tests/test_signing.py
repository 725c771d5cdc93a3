"""Signed artifacts: `build --sign-key` writes manifest.sig, `verify --trust` refuses an unsigned
artifact, another key's signature, and a swapped model.so whose manifest was recomputed to match."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import run_edgetune, write_tiny_recipe
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_artifact import make_artifact

from edgetune.archive import archive_directory
from edgetune.errors import InputError
from edgetune.package.artifact import write_manifest
from edgetune.package.signing import load_private_key, load_public_key, sign_manifest, signature_problem


@pytest.fixture(scope="module")
def signed_build(tiny_build, tmp_path_factory) -> Path:
    """A copy of tiny_build, built again with --sign-key: its inputs are unchanged, so the packaged
    artifact is kept and only signed (and re-archived)."""
    directory = tmp_path_factory.mktemp("signed") / "build"
    shutil.copytree(tiny_build[0], directory, symlinks=True)
    assert run_edgetune("keygen", "key.pem", cwd=directory).returncode == 0
    assert run_edgetune("keygen", "other.pem", cwd=directory).returncode == 0
    run = run_edgetune("build", "tiny.yaml", "--sign-key", "key.pem", cwd=directory)
    assert run.returncode == 0, run.stdout + run.stderr
    return directory


def test_a_signed_build_verifies_with_its_key(signed_build: Path) -> None:
    manifest = json.loads((signed_build / "out/tiny/host/manifest.json").read_text())
    assert "manifest.sig" not in manifest["files"]
    with tarfile.open(signed_build / "out/tiny/host.tar.gz") as tar:
        assert "host/manifest.sig" in tar.getnames()
    run = run_edgetune("verify", "out/tiny/host.tar.gz", "--trust", "key.pem.pub", cwd=signed_build)
    assert run.returncode == 0 and "signature: OK" in run.stdout, run.stderr


def test_another_key_or_no_signature_is_refused(signed_build: Path, tmp_path: Path) -> None:
    run = run_edgetune("verify", "out/tiny/host.tar.gz", "--trust", "other.pem.pub", cwd=signed_build)
    assert run.returncode == 1 and "signature does not match" in run.stderr
    unsigned = tmp_path / "host"
    shutil.copytree(signed_build / "out/tiny/host", unsigned)
    (unsigned / "manifest.sig").unlink()
    assert run_edgetune("verify", str(unsigned), cwd=tmp_path).returncode == 0  # fine without --trust
    run = run_edgetune("verify", str(unsigned), "--trust", str(signed_build / "key.pem.pub"), cwd=tmp_path)
    assert run.returncode == 1 and "not signed" in run.stderr


def test_a_swapped_library_with_a_recomputed_manifest_is_refused(signed_build: Path, tmp_path: Path) -> None:
    swapped = tmp_path / "host"
    shutil.copytree(signed_build / "out/tiny/host", swapped)
    (swapped / "model.so").write_bytes(b"\x7fELF not the library that was signed")
    manifest = json.loads((swapped / "manifest.json").read_text())
    del manifest["files"]
    write_manifest(swapped, manifest)  # what an attacker does: checksums all match again
    archive = archive_directory(swapped, tmp_path / "host.tar.gz")
    run = run_edgetune("verify", str(archive), "--trust", str(signed_build / "key.pem.pub"), cwd=tmp_path)
    assert run.returncode == 1 and "host/manifest.sig: the signature does not match" in run.stderr
    assert "Traceback" not in run.stderr and "output vs reference" not in run.stdout


def test_raw_keys_sign_deterministically(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    (tmp_path / "key.raw").write_bytes(key.private_bytes_raw())
    (tmp_path / "key.pub.raw").write_bytes(key.public_key().public_bytes_raw())
    directory = make_artifact(tmp_path / "a")
    sign_manifest(directory, load_private_key(tmp_path / "key.raw"))
    first = archive_directory(directory, tmp_path / "first.tar.gz").read_bytes()
    sign_manifest(directory, load_private_key(tmp_path / "key.raw"))
    assert archive_directory(directory, tmp_path / "second.tar.gz").read_bytes() == first
    assert signature_problem(directory, load_public_key(tmp_path / "key.pub.raw")) is None


def test_bad_key_files_are_input_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InputError, match="junk.pem: not an unencrypted PEM Ed25519 private key"):
        load_private_key(tmp_path / "junk.pem")
    with pytest.raises(InputError, match="missing.pub: cannot read the public key"):
        load_public_key(tmp_path / "missing.pub")
    write_tiny_recipe(tmp_path)
    run = run_edgetune("build", "tiny.yaml", "--sign-key", "junk.pem", cwd=tmp_path)
    assert run.returncode == 2 and "junk.pem: not an unencrypted PEM" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out" / "tiny" / "records").exists()  # refused before any work
    (tmp_path / "mine.pem").write_text("x")
    run = run_edgetune("keygen", "mine.pem", cwd=tmp_path)
    assert run.returncode == 2 and "does not overwrite" in run.stderr and (tmp_path / "mine.pem").read_text() == "x"
