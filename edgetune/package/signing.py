"""Ed25519 signatures over an artifact's manifest.json.

The manifest holds the sha256 of every file, so one signature over its exact bytes vouches for the
whole artifact: a swapped model.so with a recomputed manifest no longer matches the signature.
Ed25519 signatures are deterministic, so a signed artifact's archive stays byte-reproducible.

Keys: a PEM file (`openssl genpkey -algorithm ed25519 -out key.pem`, public half with
`openssl pkey -in key.pem -pubout -out key.pub`, or `edgetune keygen key.pem`), or the raw 32 bytes.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgetune.errors import InputError
from edgetune.package.artifact import MANIFEST_NAME, SIGNATURE_NAME

_RAW_KEY_BYTES = 32


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The signing key in `path`: PEM (PKCS#8, unencrypted) or the raw 32-byte seed."""
    data = _read_key_file(path, "private")
    if len(data) == _RAW_KEY_BYTES:
        return Ed25519PrivateKey.from_private_bytes(data)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path}: not an unencrypted PEM Ed25519 private key nor 32 raw bytes ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise InputError(f"{path}: a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """The trusted key in `path`: PEM (SubjectPublicKeyInfo) or the raw 32 bytes."""
    data = _read_key_file(path, "public")
    if len(data) == _RAW_KEY_BYTES:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path}: not a PEM Ed25519 public key nor 32 raw bytes ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise InputError(f"{path}: a {type(key).__name__}, not an Ed25519 public key")
    return key


def _read_key_file(path: Path, kind: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {kind} key: {exc.strerror or exc}") from exc


def sign_manifest(directory: Path, key: Ed25519PrivateKey) -> Path:
    """`manifest.sig` beside the manifest: base64 of the signature of its exact bytes."""
    signature = key.sign((directory / MANIFEST_NAME).read_bytes())
    path = directory / SIGNATURE_NAME
    path.write_text(base64.b64encode(signature).decode() + "\n")
    return path


def signature_matches(directory: Path, key: Ed25519PublicKey) -> bool:
    return signature_problem(directory, key) is None


def signature_problem(directory: Path, key: Ed25519PublicKey) -> str | None:
    """Why the artifact in `directory` is not signed by `key`, or None when it is."""
    path = directory / SIGNATURE_NAME
    if not path.is_file() or path.is_symlink():
        return f"{path}: missing: the artifact is not signed (build it with --sign-key)"
    try:
        signature = base64.b64decode(path.read_bytes().strip(), validate=True)
        key.verify(signature, (directory / MANIFEST_NAME).read_bytes())
    except (binascii.Error, ValueError):
        return f"{path}: not a base64 Ed25519 signature"
    except InvalidSignature:
        return (f"{path}: the signature does not match {MANIFEST_NAME} and the trusted key: the manifest was "
                "altered or signed by another key")
    except OSError as exc:
        return f"{path}: cannot be read: {exc.strerror or exc}"
    return None


def generate_key_pair(private_path: Path) -> Path:
    """A new key: PEM private key at `private_path` (mode 600, never overwritten), public key beside it
    as `<name>.pub`; returns the public key's path."""
    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise InputError(f"{path}: exists; edgetune does not overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    descriptor = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as stream:
        stream.write(pem)
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return public_path
