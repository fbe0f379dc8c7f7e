"""The tokens/s of the `jaxgen` summary line: new tokens over the time spent generating them.

The compile seconds subtracted must come from the same window as the elapsed time: the
summary measures both around the generate call alone. (It once took the compile seconds
from before `init_state`: with the generate program read back from the executable cache,
the small eager programs compiled there outweighed the whole call, and the clamp to 1e-9 s
printed "8000000000.0 tokens/s".) Should compile time still exceed the window (compiles on
another thread), the rate falls back to the whole window: never above what was measured.

Example:
    >>> tokens_per_second(8, elapsed_s=2.0, compile_s=1.5)
    16.0
    >>> tokens_per_second(8, elapsed_s=0.1, compile_s=0.2)  # compile outside the window
    80.0
    >>> tokens_per_second(0, elapsed_s=0.0, compile_s=0.0)
    0.0
"""
from __future__ import annotations


def tokens_per_second(new_tokens: int, elapsed_s: float, compile_s: float) -> float:
    """new_tokens / (elapsed_s - compile_s), or / elapsed_s when the compile seconds leave
    nothing of the window; 0.0 when no time passed or nothing was generated."""
    if new_tokens <= 0 or elapsed_s <= 0:
        return 0.0
    running = elapsed_s - max(compile_s, 0.0)
    return new_tokens / (running if running > 0 else elapsed_s)


__all__ = ["tokens_per_second"]
