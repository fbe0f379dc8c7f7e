"""Building a pattern's outlines-core Index with bounded time and memory.

A regex's automaton can be exponentially larger than the regex (`[ab]*a[ab]{30}` needs 2^30
states), and a JSON schema's `pattern` or large `maxLength` / `maxItems` reach the same
builder, from a server's request too. The build runs in a child process
(`index_worker.py`, outlines-core only) that is killed past `BUILD_SECONDS` and cannot
allocate past `BUILD_BYTES`; either way the caller gets `ConstraintTooComplex`, a
ValueError that names the constraint and the bound. The caller's own memory does not grow,
and builds run one at a time (a server's concurrent requests hold one child, not many).

Example:
    >>> import outlines_core
    >>> vocabulary = outlines_core.Vocabulary(3, {b"a": [0], b"b": [1]})
    >>> index = build_index("(ab)+", vocabulary, kind="regex")
    >>> index.get_initial_state() in index.get_transitions()
    True
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading

BUILD_SECONDS = 60.0  # a nested JSON schema on SmolLM2's 49k tokens builds in ~0.6 s
BUILD_BYTES = 4 << 30  # the child's address space
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "index_worker.py")
_ONE_AT_A_TIME = threading.Lock()


class ConstraintTooComplex(ValueError):
    """A constraint whose token automaton is past the build's time or memory bound."""


def build_index(pattern: str, vocabulary, *, kind: str, seconds: float | None = None,
                memory_bytes: int | None = None):
    """outlines_core.Index(pattern, vocabulary), built in a child process within `seconds`
    (BUILD_SECONDS) and `memory_bytes` (BUILD_BYTES). ConstraintTooComplex past either;
    a ValueError with the builder's message for a pattern it refuses."""
    seconds = BUILD_SECONDS if seconds is None else seconds
    memory_bytes = BUILD_BYTES if memory_bytes is None else memory_bytes
    request = pickle.dumps((pattern, vocabulary))
    with _ONE_AT_A_TIME:  # so concurrent requests hold one child's memory, not many
        return _run_child(request, kind, seconds, memory_bytes)


def _run_child(request: bytes, kind: str, seconds: float, memory_bytes: int):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # ours
    with subprocess.Popen([sys.executable, _WORKER, str(int(memory_bytes))], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as child:
        try:
            output, errors = child.communicate(request, timeout=seconds)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise ConstraintTooComplex(
                f"`{kind}`: its token automaton did not build within {seconds:g} s (the "
                f"pattern's automaton grows too large: e.g. a repetition count or a "
                f"'[ab]*a[ab]{{n}}'-like pattern; simplify it)") from None
    # a child that died (an allocation past the cap aborts it) wrote nothing or a torn pickle
    status, value = pickle.loads(output) if child.returncode == 0 else ("memory", "")
    if status == "index":
        return value
    if status == "memory":
        raise ConstraintTooComplex(
            f"`{kind}`: its token automaton needs more than {memory_bytes / 2**30:g} GiB to "
            f"build (the pattern's automaton grows too large; simplify it)"
            + (f" [{errors.decode(errors='replace').strip()[-200:]}]" if errors else ""))
    raise ValueError(value)


__all__ = ["BUILD_BYTES", "BUILD_SECONDS", "ConstraintTooComplex", "build_index"]
