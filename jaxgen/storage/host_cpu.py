"""`host_cpu()`: the host CPU's vendor and feature flags, for the keys of what jaxgen keeps
between runs that only this kind of CPU may load (the native kernels' libraries, compiled
executables: XLA:CPU and the C++ compiler build for the features they find).

Example:
    >>> isinstance(host_cpu(), str) and host_cpu() != ""
    True
"""
from __future__ import annotations

import functools
import pathlib
import platform

FIELDS = ("vendor_id", "flags", "CPU implementer", "Features")  # x86, then ARM names


@functools.cache
def host_cpu() -> str:
    """The first value of each of FIELDS in /proc/cpuinfo ("name: value; ..."), or the
    machine name where there is no such file or field."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    found = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() in FIELDS and name.strip() not in found:
            found[name.strip()] = value.strip()
    described = "; ".join(f"{name}: {found[name]}" for name in FIELDS if name in found)
    return described or platform.machine()


__all__ = ["FIELDS", "host_cpu"]
