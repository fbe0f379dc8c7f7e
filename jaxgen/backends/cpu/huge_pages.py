"""Arrays copied onto transparent huge pages (Linux): one private anonymous mapping advised
MADV_HUGEPAGE, each array a zero-copy jax array over its own 2 MiB-aligned slice of it.

A decode step streams every weight once. On 4 KiB pages the CPU's prefetchers stop at every
page and each page costs a TLB walk; on 2 MiB pages the same stream reads faster (a 1 GiB
two-thread read on an Intel AVX-512 host: 24 GB/s on 4 KiB pages, 28-31 on 2 MiB). XLA:CPU
allocates with malloc, which gets huge pages only where the system's THP mode is "always";
under "madvise" (the common default) this copy is how weights get them.

    thp_mode()                  the system's THP mode: "always", "madvise", "never", or None
    available_bytes()           MemAvailable (bytes), or None
    on_huge_pages(arrays, stop) {id(array): its copy on huge pages} for the CPU arrays of at
                                least HUGE_PAGE bytes (one mapping for all of them), or {}

Faulting a fresh huge page in costs more than a small page on some virtual machines (2 MiB
the host may not have touched yet: 0.2-1.6 s for 540 MB on one, against 0.4 s on 4 KiB
pages), so callers make this copy off the critical path (`jaxgen.runtime.compiled` makes it
in the background once a laid-out copy of the weights is used a second time).

Example:
    >>> import jax.numpy as jnp
    >>> weight = jnp.arange(HUGE_PAGE // 4, dtype=jnp.float32)     # 2 MiB
    >>> copies = on_huge_pages([weight])
    >>> bool((copies[id(weight)] == weight).all()) if copies else True
    True
"""
from __future__ import annotations

import mmap
import pathlib

import jax
import numpy as np

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
_THP_ENABLED = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MEMINFO = pathlib.Path("/proc/meminfo")
# The copy is made only while the system has this much memory to spare beyond it (the
# originals stay alive until the copy replaces them: a copy must never bring the OOM killer).
SPARE_FRACTION, SPARE_BYTES = 0.25, 512 << 20


def thp_mode() -> str | None:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled ("always",
    "madvise" or "never"), or None where the file does not exist or cannot be read."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _advise_huge(mapping: mmap.mmap) -> bool:
    """Asks for huge pages over the whole mapping before its pages are touched; False where
    the system refuses (no THP, or a Python without mmap.madvise)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def on_huge_pages(arrays, stop=lambda: False) -> dict[int, jax.Array]:
    """{id(array): copy} for each distinct single-device CPU jax.Array of at least HUGE_PAGE
    bytes among `arrays`, all copied into one anonymous mapping advised for huge pages, each
    starting on a huge-page boundary; {} where the system gives no huge pages this way (THP
    "never", no mmap.madvise), has too little memory to spare for the copy (MemAvailable
    below its size x (1 + SPARE_FRACTION) + SPARE_BYTES) or jax would copy the bytes again
    instead of reading them in place (a dtype XLA packs, such as int4). Each copy holds its
    original's values, shape, dtype and device, and is committed exactly when its original
    is; the mapping lives as long as any copy does. `stop()` is asked before each array: true
    abandons the copy ({}).
    """
    chosen, seen = [], set()
    for array in arrays:
        if (isinstance(array, jax.Array) and id(array) not in seen
                and array.nbytes >= HUGE_PAGE and len(array.devices()) == 1
                and next(iter(array.devices())).platform == "cpu"):
            seen.add(id(array))
            chosen.append(array)
    if not chosen or thp_mode() == "never":
        return {}
    slots = [-(-array.nbytes // HUGE_PAGE) * HUGE_PAGE for array in chosen]
    spare = available_bytes()
    if spare is None or spare < sum(slots) * (1 + SPARE_FRACTION) + SPARE_BYTES:
        return {}
    mapping = mmap.mmap(-1, sum(slots) + HUGE_PAGE,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not _advise_huge(mapping):
        mapping.close()
        return {}
    whole = np.frombuffer(mapping, dtype=np.uint8)  # [bytes]
    offset = -_address(whole) % HUGE_PAGE
    copies = {}
    for array, slot in zip(chosen, slots):
        if stop():
            return {}
        host = np.asarray(array)  # a view of XLA:CPU's buffer where it allows one
        view = whole[offset:offset + host.nbytes].view(host.dtype).reshape(host.shape)
        np.copyto(view, host)
        # committed as the original is (jit keys on it: a changed commitment compiles again)
        copy = jax.device_put(view, array.sharding if array.committed else None)
        if copy.unsafe_buffer_pointer() != _address(view):  # jax copied it: no gain
            return {}
        copies[id(array)] = copy
        offset += slot
    return copies


__all__ = ["HUGE_PAGE", "SPARE_BYTES", "SPARE_FRACTION", "available_bytes", "on_huge_pages",
           "thp_mode"]
