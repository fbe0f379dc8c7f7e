"""`continue_state`: a finished call's rows continued with new tokens, without recomputing
what the cache already holds.

    out = jaxgen.generate(params, state, cfg)                 # turn 1
    state = jaxgen.continue_state(out, new_tokens, cfg)       # new_tokens: one id list per row
    out = jaxgen.generate(params, state, cfg)                 # turn 2: prefills new_tokens only

Row b of the new state is row b's prompt + generated tokens (out.sequences[b, :lengths[b]],
or its first keep[b]), then new_tokens[b] (ragged; may be empty). Its cache is the old one
copied into a state of the bucket the longer history needs (jaxgen.core.cached_prefix), and
the next generate prefills only the positions the cache does not hold (the new tokens, plus
the previous answer's last token, which no forward has read yet), from each row's cached
length on (`DecodeState.cached`). The tokens are those of a call from scratch on the whole
history: greedy exactly; sampling too, as each row keeps its PRNG key and a step's key is
fold_in(row key, position). The old output stays valid (the cache is copied, not donated),
so one output can be continued more than once. Beam outputs carry no state and are refused.

Example:
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3], [4, 5]], cfg), cfg)
    >>> state = continue_state(out, [[6, 7], [8]], cfg)
    >>> (state.prompt_len - state.cached).tolist()     # the new tokens + the last answer token
    [3, 2]
    >>> state.prefill_width                            # the block the prefill runs
    16
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxgen.config.generation import GenerationConfig
from jaxgen.core.cached_prefix import CachedPrefix
from jaxgen.core.output import GenerateOutput
from jaxgen.core.state import DecodeState, init_state

CONSUMED_STATE = ("this state was consumed by an earlier generate call (its buffers were "
                  "donated); continue from the output that call returned (out)")


def _state_of(previous) -> DecodeState:
    """The DecodeState to continue: previous itself, or a GenerateOutput's final state."""
    if isinstance(previous, GenerateOutput):
        if previous.state is None:
            what = ("a beam-search output (num_beams > 1) carries no state"
                    if previous.sequences_scores is not None else "this output carries no state")
            raise ValueError(f"cannot continue: {what}; build a new state from its sequences "
                             f"with init_state instead")
        previous = previous.state
    if not isinstance(previous, DecodeState):
        raise ValueError(f"continue_state continues a jaxgen.GenerateOutput (or its "
                         f".state), got {type(previous).__name__}")
    leaves = jax.tree_util.tree_leaves(previous)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        raise ValueError("continue_state runs on the host: call it outside jax.jit / jax.vmap")
    if any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in leaves):
        raise ValueError(CONSUMED_STATE)
    return previous


def cached_rows(previous, keep=None) -> CachedPrefix:
    """The rows of a finished call as a CachedPrefix: tokens = each row's prompt + generated
    tokens (its first keep[b] with `keep`), cached = what its cache holds of them."""
    state = _state_of(previous)
    tokens = np.asarray(state.tokens)  # [B, T]
    length = np.asarray(state.length)  # [B]
    if keep is not None:
        keep = np.broadcast_to(np.asarray(keep, np.int64), length.shape)
        if (keep < 0).any() or (keep > length).any():
            raise ValueError(f"keep must lie in 0..length per row ({length.tolist()}), got "
                             f"{keep.tolist()}")
        length = keep
    held = np.minimum(np.asarray(state.cache.length), length)  # [B]
    return CachedPrefix(model=state.model,
                        tokens=tuple(tuple(tokens[b, :n].tolist()) for b, n in enumerate(length)),
                        cached=tuple(int(n) for n in held), cache=state.cache)


def continue_state(previous, new_tokens: Sequence[Sequence[int]],
                   cfg: GenerationConfig | None = None, key=None, *, keep=None, model=None,
                   max_new_tokens=None, tokenizer=None, constraint=None) -> DecodeState:
    """A new state whose rows continue `previous` (a GenerateOutput or its final state) with
    `new_tokens` (one id list per row, ragged, possibly empty); see the module docs.

    cfg: the next call's config (its budget counts new tokens after the new prompt; the same
    cache_implementation / cache_config as the previous call). key: None keeps each row's
    PRNG key (sampling then draws as a call from scratch with those keys would).
    keep: optional [B] (or one int): keep only each row's first keep[b] tokens before the new
    ones (e.g. the longest prefix a re-encoded chat template shares with them).
    model: optional, the model the next call runs: refused if it is not the one that
    computed the cache. max_new_tokens / tokenizer / constraint: as for init_state.
    The previous call's cache dtype is kept.
    """
    cfg = cfg if cfg is not None else GenerationConfig()
    state = _state_of(previous)
    if model is not None and model != state.model:
        raise ValueError(f"cannot continue with another model: the cache was computed by "
                         f"{type(state.model).__name__} {getattr(state.model, 'config', '')!r},"
                         f" not {type(model).__name__} {getattr(model, 'config', '')!r}")
    if isinstance(new_tokens, (np.ndarray, jax.Array)) or not isinstance(new_tokens, Sequence) \
            or len(new_tokens) != state.batch \
            or not all(isinstance(row, (Sequence, np.ndarray)) for row in new_tokens):
        raise ValueError(f"new_tokens must be one token-id list per row ({state.batch} lists, "
                         f"each possibly empty)")
    if cfg.sample_copies > 1:
        raise ValueError("continue_state continues each row one for one: use "
                         "num_return_sequences=1 (the previous call's rows are its copies)")
    prefix = cached_rows(state, keep)
    cache = state.cache
    dtype = getattr(cache, "dtype", None)
    dtype = cache.k.dtype if dtype is None else dtype
    return init_state(state.model, [list(row) for row in new_tokens], cfg,
                      state.key if key is None else key, max_new_tokens=max_new_tokens,
                      cache_dtype=dtype, tokenizer=tokenizer, constraint=constraint,
                      prefix=prefix)


def continue_to(previous, rows: Sequence[Sequence[int]], cfg: GenerationConfig | None = None,
                key=None, **options) -> DecodeState:
    """A new state whose rows hold exactly `rows` (one full id list per row, e.g. a chat
    history re-encoded with its template): each row keeps the longest prefix it shares with
    `previous`'s tokens and continues with the rest (`continue_state(keep=...)`), so a
    re-encoding that differs from what was generated is recomputed from where it differs.
    options: as for continue_state."""
    state = _state_of(previous)
    if not isinstance(rows, Sequence) or len(rows) != state.batch:
        raise ValueError(f"rows must be one token-id list per row ({state.batch} lists)")
    tokens = np.asarray(state.tokens)  # [B, T]
    length = np.asarray(state.length)  # [B]
    keep, new = [], []
    for b, row in enumerate(rows):
        row = [int(t) for t in row]
        held = tokens[b, :length[b]]
        limit = min(len(held), len(row))
        same = np.flatnonzero(held[:limit] != np.asarray(row[:limit], held.dtype))
        shared = int(same[0]) if same.size else limit
        keep.append(shared)
        new.append(row[shared:])
    return continue_state(state, new, cfg, key, keep=keep, **options)
