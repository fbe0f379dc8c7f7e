"""Building a pattern's outlines-core Index with bounded time and memory.

A regex's automaton can be exponentially larger than the regex (`[ab]*a[ab]{30}` needs 2^30
states), and a JSON schema's `pattern` or large `maxLength` / `maxItems` reach the same
builder, from a server's request too. The build runs in a child process (`index_worker.py`,
outlines-core only) that is killed past `BUILD_SECONDS` and caps its own address space at
`BUILD_BYTES` and its CPU time (never above the limits it inherits); a child that dies of a
signal (an allocation past the cap aborts it; the CPU cap or the timer kills it) is
`ConstraintTooComplex`, a ValueError that names the constraint and the bound, and so is
every later build of that pattern (the last REFUSED_SIZE refusals are kept). The child is
killed on any way out of the wait (an interrupt included). Builds run one at a time, so
concurrent requests hold one child's memory; a build that cannot start within BUILD_SECONDS
is `ConstraintBuildBusy`. Where no child can run (no usable `sys.executable`, a frozen
app) or it fails for another reason, the Index is built in this process, unbounded.

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
REFUSED_SIZE = 64  # patterns refused for a bound, remembered so a retry costs nothing
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "index_worker.py")
_ONE_AT_A_TIME = threading.Lock()
_REFUSED: dict = {}  # (pattern, id(vocabulary)) -> (vocabulary, message), oldest first


class ConstraintTooComplex(ValueError):
    """A constraint whose token automaton is past the build's time or memory bound."""


class ConstraintBuildBusy(RuntimeError):
    """Another constraint's build held the builder for the whole wait."""


def build_index(pattern: str, vocabulary, *, kind: str, seconds: float | None = None,
                memory_bytes: int | None = None):
    """outlines_core.Index(pattern, vocabulary), built in a child process within `seconds`
    (BUILD_SECONDS) and `memory_bytes` (BUILD_BYTES). ConstraintTooComplex past either;
    a ValueError with the builder's message for a pattern it refuses."""
    seconds = BUILD_SECONDS if seconds is None else seconds
    memory_bytes = BUILD_BYTES if memory_bytes is None else memory_bytes
    key = (pattern, id(vocabulary))
    if key in _REFUSED and _REFUSED[key][0] is vocabulary:
        raise ConstraintTooComplex(_REFUSED[key][1])
    if not _ONE_AT_A_TIME.acquire(timeout=seconds):
        raise ConstraintBuildBusy(f"`{kind}`: another constraint's automaton held the builder "
                                  f"for {seconds:g} s; retry later")
    try:
        return _run_child(pickle.dumps((pattern, vocabulary)), kind, seconds, memory_bytes)
    except ConstraintTooComplex as refused:
        _REFUSED[key] = (vocabulary, str(refused))
        while len(_REFUSED) > REFUSED_SIZE:
            _REFUSED.pop(next(iter(_REFUSED)))
        raise
    except _NoChild:
        import outlines_core

        try:
            return outlines_core.Index(pattern, vocabulary)
        except Exception as error:
            raise ValueError(str(error).split("\n")[0]) from None
    finally:
        _ONE_AT_A_TIME.release()


class _NoChild(Exception):
    """The child could not run the build (no usable interpreter, a start-up failure)."""


def _run_child(request: bytes, kind: str, seconds: float, memory_bytes: int):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # ours
    command = [sys.executable, _WORKER, str(int(memory_bytes)), str(int(seconds) + 1)]
    try:
        child = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except (OSError, ValueError):  # no interpreter at sys.executable
        raise _NoChild() from None
    try:
        output, errors = child.communicate(request, timeout=seconds)
    except subprocess.TimeoutExpired:
        raise ConstraintTooComplex(
            f"`{kind}`: its token automaton did not build within {seconds:g} s (the "
            f"pattern's automaton grows too large: e.g. a repetition count or a "
            f"'[ab]*a[ab]{{n}}'-like pattern; simplify it)") from None
    finally:  # whatever ends the wait (a timeout, an interrupt), the child goes with it
        if child.poll() is None:
            child.kill()
            child.communicate()
    if child.returncode < 0 or (child.returncode == 0 and not output):  # died of a signal
        raise ConstraintTooComplex(
            f"`{kind}`: its token automaton needs more than {memory_bytes / 2**30:g} GiB or "
            f"{seconds:g} s of CPU to build (the pattern's automaton grows too large; "
            f"simplify it)")
    if child.returncode != 0:  # it could not start the build (an interpreter that is not
        raise _NoChild()  # Python, a missing package): build here instead
    status, value = pickle.loads(output)
    if status == "index":
        return value
    if status == "memory":
        raise ConstraintTooComplex(
            f"`{kind}`: its token automaton needs more than {memory_bytes / 2**30:g} GiB to "
            f"build (the pattern's automaton grows too large; simplify it)")
    raise ValueError(value)


__all__ = ["BUILD_BYTES", "BUILD_SECONDS", "REFUSED_SIZE", "ConstraintBuildBusy",
           "ConstraintTooComplex", "build_index"]
