"""The outlines-core Index build, run as a script in a child process (`index_build.py`).

Reads a pickled (pattern, vocabulary) from stdin, caps its own address space and CPU time
(never above the limits it inherited), builds `outlines_core.Index(pattern, vocabulary)` and
writes ("index", the pickled Index) or ("error", the builder's first line) to stdout. It
imports outlines-core only, not jaxgen: a start costs tens of milliseconds, not a JAX import.

    python index_worker.py MEMORY_BYTES CPU_SECONDS < (pattern, vocabulary) > result
"""
import pickle
import sys


def _cap(kind: int, wanted: int) -> None:
    """Lowers the soft and hard limit `kind` to `wanted` (never raises an inherited one)."""
    import resource

    soft, hard = resource.getrlimit(kind)
    value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(kind, (value, value))


def main() -> int:
    memory_bytes, cpu_seconds = int(sys.argv[1]), int(sys.argv[2])
    try:
        import resource

        _cap(resource.RLIMIT_AS, memory_bytes)
        _cap(resource.RLIMIT_CPU, cpu_seconds)
    except (ImportError, ValueError, OSError):  # no `resource` (Windows): the parent's timer
        pass
    pattern, vocabulary = pickle.load(sys.stdin.buffer)
    import outlines_core

    try:
        result = ("index", outlines_core.Index(pattern, vocabulary))
    except MemoryError:
        result = ("memory", "")
    except Exception as error:  # the regex compiler's own message, for the caller to word
        result = ("error", str(error).split("\n")[0])
    pickle.dump(result, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
