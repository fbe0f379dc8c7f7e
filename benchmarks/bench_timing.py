"""Timing helpers the speculative-decoding benchmarks share: best-of-N wall seconds of a
compiled call, and of one whole generate() call.

    >>> best_of(lambda: 1 + 1, repeats=2) >= 0.0
    True
"""
from __future__ import annotations

import time

import jax

import jaxgen

# Chat prompts whose answers are long enough for several drafting rounds.
PROMPTS = ["Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue.",
           "List five fruits and their colors."]


def best_of(fn, repeats: int) -> float:
    """Best wall seconds of fn() (already compiled: it runs once first)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def timed_generate(params, model, prompt, cfg, repeats, **kw):
    """(best seconds, output) of one generate call; kw go to jaxgen.api.generate."""
    run = lambda: jaxgen.generate(params, jaxgen.init_state(model, prompt, cfg), cfg, **kw)  # noqa
    out = run()
    return best_of(lambda: run().sequences, repeats), out
