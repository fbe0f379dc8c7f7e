"""The outlines-core Index build, run as a script in a child process (`index_build.py`).

Reads a pickled (pattern, vocabulary) from stdin, caps its own address space at the given
bytes, builds `outlines_core.Index(pattern, vocabulary)` and writes the pickled Index (or the
error's first line, as ("error", text)) to stdout. It imports outlines-core only, not jaxgen:
a start costs tens of milliseconds, not a JAX import.

    python index_worker.py MEMORY_BYTES < (pattern, vocabulary) pickle > result pickle
"""
import pickle
import resource
import sys


def main() -> int:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
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
