"""JAX's persistent compilation cache kept tidy: its files 0600 in jaxgen's private xla/
folder, and an entry JAX could not read removed so that it is written again.

JAX writes an entry with a plain file write (mode 0666 less the umask) and never replaces
one that exists: a truncated or damaged entry made every later run warn ("Error reading
persistent compilation cache entry") and compile again. `guard()` wraps JAX's read and write
of an entry: a read that fails removes the entry's files (JAX then compiles and its write,
in the same run, stores the program again), and a write in a folder jaxgen made private
narrows the new file to 0600. The folder itself is 0700 (jaxgen.storage.private), so even
before that, nobody else can read or plant an entry, whatever the umask.

This leans on two functions of jax._src.compilation_cache (`get_executable_and_time`,
`put_executable_and_time`) and its file names (`<key>-cache`, `<key>-atime`); when they are
missing, `guard()` returns False and JAX's cache works as it does on its own.

Example (once per process, however often it is called):
    >>> guard(), guard()
    (True, True)
"""
from __future__ import annotations

import functools
import logging
import os
import pathlib

logger = logging.getLogger(__name__)

ENTRY_SUFFIXES = ("-cache", "-atime")  # jax._src.lru_cache's files for one key
_PRIVATE_FOLDERS: set[str] = set()  # xla/ folders jaxgen made private: their files are narrowed


def mark_private(folder: str | os.PathLike) -> None:
    """Files JAX writes in `folder` (a private folder of jaxgen's) are narrowed to 0600."""
    _PRIVATE_FOLDERS.add(os.path.realpath(folder))


def _folder() -> pathlib.Path | None:
    import jax

    folder = jax.config.jax_compilation_cache_dir
    if not folder or "://" in str(folder):
        return None
    return pathlib.Path(folder)


def _remove_entry(key: str) -> None:
    folder = _folder()
    if folder is None or not key or "/" in key or key.startswith("."):
        return
    removed = False
    for suffix in ENTRY_SUFFIXES:
        try:
            os.remove(folder / f"{key}{suffix}")
            removed = True
        except OSError:
            pass
    if removed:
        logger.warning("removed the unreadable compilation cache entry %s in %s; it is "
                       "written again", key, folder)


def _narrow(key: str) -> None:
    folder = _folder()
    if folder is None or os.path.realpath(folder) not in _PRIVATE_FOLDERS:
        return
    for suffix in ENTRY_SUFFIXES:
        try:
            handle = os.open(folder / f"{key}{suffix}", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(handle).st_uid == os.geteuid():
                os.fchmod(handle, 0o600)
        finally:
            os.close(handle)


def guard() -> bool:
    """Wraps JAX's persistent-cache read and write (once per process); False when this jax
    has not the functions it wraps."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        return False
    read = getattr(compilation_cache, "get_executable_and_time", None)
    write = getattr(compilation_cache, "put_executable_and_time", None)
    if read is None or write is None:
        return False
    if getattr(read, "jaxgen_guard", False):
        return True

    @functools.wraps(read)
    def read_or_remove(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception:
            _remove_entry(cache_key)
            raise

    @functools.wraps(write)
    def write_and_narrow(cache_key, *args, **kwargs):
        result = write(cache_key, *args, **kwargs)
        _narrow(cache_key)
        return result

    read_or_remove.jaxgen_guard = True
    compilation_cache.get_executable_and_time = read_or_remove
    compilation_cache.put_executable_and_time = write_and_narrow
    return True


__all__ = ["guard", "mark_private"]
