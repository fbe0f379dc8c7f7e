"""Checksums nobody else can forge: BLAKE2b keyed with a secret of the user's, kept in a
private file (0600, in a private folder) beside the caches it signs.

A cache entry carries `sign(key, body)`; `verify` compares in constant time. Without the key
(another user, a planted file) no entry can be made that verifies, so a forged executable or
a swapped weight is refused before anything is parsed.

Example:
    >>> import tempfile
    >>> key = user_key(tempfile.mkdtemp())
    >>> tag = sign(key, b"body")
    >>> verify(key, b"body", tag), verify(key, b"bodY", tag), len(tag)
    (True, False, 32)
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import secrets

from jaxgen.storage.private import private_folder, read_private_file, write_private_file

KEY_FILE = "key"
KEY_BYTES = 32
TAG_BYTES = 32


def user_key(folder: str | os.PathLike) -> bytes:
    """The secret in `folder`/key, created (32 random bytes, 0600) when missing or malformed.
    OSError (NotPrivate included) when the folder or the file is not private."""
    folder = private_folder(folder)
    path = pathlib.Path(folder) / KEY_FILE
    try:
        key = read_private_file(path)
    except FileNotFoundError:
        key = b""
    if len(key) != KEY_BYTES:
        write_private_file(path, secrets.token_bytes(KEY_BYTES))
        key = read_private_file(path)  # the file a parallel writer left wins for both
    return key


def sign(key: bytes, *parts: bytes) -> bytes:
    """The keyed BLAKE2b of the parts (each length-prefixed: parts cannot be re-cut)."""
    digest = hashlib.blake2b(key=key, digest_size=TAG_BYTES)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def verify(key: bytes, *parts_and_tag: bytes) -> bool:
    """True when the last argument is sign(key, *the others)."""
    *parts, tag = parts_and_tag
    return hmac.compare_digest(sign(key, *parts), tag)


__all__ = ["KEY_BYTES", "TAG_BYTES", "sign", "user_key", "verify"]
