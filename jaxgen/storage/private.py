"""Private folders and files: what every jaxgen cache is made of.

A folder jaxgen creates is 0700 and a file 0600, whatever the umask. Before anything is read
from a folder (and always before a shared library is loaded or an executable deserialised)
the folder and every folder above it are checked: each is owned by the user or by root, and
none is writable by group or others, except a sticky folder owned by root (such as /tmp),
whose entry below must then be the user's own. A file must be the user's and not writable by
group or others. A folder that fails is `NotPrivate`; `private_folder_or_fallback` warns
once, in one line, and gives a fresh private folder for this process instead.

Example:
    >>> import tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> folder = private_folder(root / "cache" / "kernels")
    >>> oct(folder.stat().st_mode & 0o777)
    '0o700'
    >>> write_private_file(folder / "entry", b"data")
    >>> read_private_file(folder / "entry"), oct((folder / "entry").stat().st_mode & 0o777)
    (b'data', '0o600')
    >>> os.chmod(folder, 0o777)
    >>> private_folder(folder)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    jaxgen.storage.private.NotPrivate: ... is writable by group or others (mode 0o777)
"""
from __future__ import annotations

import os
import pathlib
import stat
import tempfile
import threading
import warnings

_FALLBACKS: dict[str, pathlib.Path] = {}  # refused folder -> this process's private one
_LOCK = threading.Lock()


class NotPrivate(OSError):
    """A folder or file that another user could have written."""


def _uid() -> int:
    return os.geteuid()


def _check_folder_chain(real: pathlib.Path) -> None:
    """NotPrivate unless `real` (resolved, existing) and the folders above it are safe."""
    uid = _uid()
    chain = [real, *real.parents]
    for index, folder in enumerate(chain):
        info = folder.stat()
        if not stat.S_ISDIR(info.st_mode):
            raise NotPrivate(f"{folder} is not a folder")
        if info.st_uid not in (uid, 0):
            raise NotPrivate(f"{folder} belongs to another user (uid {info.st_uid})")
        if index == 0 and info.st_uid != uid:
            raise NotPrivate(f"{folder} belongs to another user (uid {info.st_uid})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            below = chain[index - 1] if index else None
            sticky_root = info.st_mode & stat.S_ISVTX and info.st_uid == 0
            if not (sticky_root and below is not None and below.stat().st_uid == uid):
                raise NotPrivate(f"{folder} is writable by group or others "
                                 f"(mode {oct(info.st_mode & 0o777)})")


def private_folder(path: str | os.PathLike) -> pathlib.Path:
    """`path` as a private folder: missing folders are created 0700 (whatever the umask); an
    existing one of the user's that others may read is narrowed to 0700. NotPrivate when the
    folder or one above it could be written by someone else."""
    path = pathlib.Path(os.path.abspath(os.path.expanduser(path)))
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # made meanwhile by another process: checked below
            pass
        else:
            os.chmod(folder, 0o700)  # the umask may have narrowed mkdir's mode, never widened
    real = pathlib.Path(os.path.realpath(path))
    _check_folder_chain(real)
    info = real.stat()
    if info.st_mode & 0o077:
        os.chmod(real, 0o700)
    return real


def private_folder_or_fallback(path: str | os.PathLike, what: str) -> pathlib.Path:
    """private_folder(path), or, when that folder is not private (or cannot be made), a fresh
    private folder for this process, with a one-line warning naming `what` and the reason."""
    try:
        return private_folder(path)
    except OSError as error:
        key = os.path.abspath(os.path.expanduser(path))
        with _LOCK:
            if key not in _FALLBACKS:
                _FALLBACKS[key] = pathlib.Path(tempfile.mkdtemp(prefix="jaxgen-"))
                warnings.warn(f"jaxgen: not using the {what} in {key} ({error}); using "
                              f"{_FALLBACKS[key]} for this run", RuntimeWarning, stacklevel=2)
            return _FALLBACKS[key]


def check_private_file(path: str | os.PathLike, info: os.stat_result | None = None) -> None:
    """NotPrivate unless `path` is a regular file of the user's that group and others cannot
    write (its folder is checked by private_folder)."""
    info = os.lstat(path) if info is None else info
    if not stat.S_ISREG(info.st_mode):
        raise NotPrivate(f"{path} is not a regular file")
    if info.st_uid != _uid():
        raise NotPrivate(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NotPrivate(f"{path} is writable by group or others "
                         f"(mode {oct(info.st_mode & 0o777)})")


def read_private_file(path: str | os.PathLike) -> bytes:
    """The bytes of `path`, checked (check_private_file) on the open file itself, never
    following a link. OSError (NotPrivate included) when it is missing or not private."""
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        check_private_file(path, os.fstat(handle))
        with os.fdopen(handle, "rb", closefd=False) as file:
            return file.read()
    finally:
        os.close(handle)


def write_private_file(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` (mode 0600) through a temporary file in the same folder and a
    rename: a reader sees the old file or the whole new one."""
    path = pathlib.Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".writing-")  # mode 0600
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise


__all__ = ["NotPrivate", "check_private_file", "private_folder", "private_folder_or_fallback",
           "read_private_file", "write_private_file"]
