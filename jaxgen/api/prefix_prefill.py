"""`prefill_prefix`: a shared prefix (system prompt, few-shot block) prefilled once, then
reused by any number of calls and rows.

    prefix = jaxgen.prefill_prefix(model, params, system_ids, cfg)
    state = jaxgen.init_state(model, user_prompts, cfg, prefix=prefix)   # prefix + each prompt
    out = jaxgen.generate(params, state, cfg)        # prefills each prompt's own tokens only

The handle (a jaxgen.CachedPrefix) holds the prefix's tokens and its cache for one row, in
the form a generate call returns it; `init_state(prefix=)` copies it into every row
(jaxgen.core.cached_prefix), so the handle is never consumed. Same tokens as the prompts
with the prefix written out. The prefix runs through `generate` (one token, greedy) with the
config's cache kind and the given `layout`, so its cache is what that call's prefill writes.

Example:
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    >>> prefix = prefill_prefix(model, params, [1, 2, 3, 4], cfg)
    >>> prefix.tokens, prefix.cached
    (((1, 2, 3, 4),), (4,))
    >>> state = jaxgen.init_state(model, [[5], [6, 7]], cfg, prefix=prefix)
    >>> state.prompt_len.tolist(), state.cached.tolist()
    ([5, 6], [4, 4])
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxgen.api.generate import generate
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.cached_prefix import CachedPrefix
from jaxgen.core.state import init_state


def prefill_prefix(model, params, prefix_ids, cfg: GenerationConfig | None = None, *,
                   cache_dtype=jnp.float32, layout: str = "auto") -> CachedPrefix:
    """The prefix `prefix_ids` (a non-empty id list) prefilled once, for
    `init_state(..., prefix=)`. cfg: the config of the calls that will use it (its
    cache_implementation / cache_config; nothing else is read). cache_dtype / layout: those of
    those calls."""
    cfg = cfg if cfg is not None else GenerationConfig()
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"cfg must be a jaxgen.GenerationConfig, got {type(cfg).__name__}")
    ids = list(prefix_ids) if not hasattr(prefix_ids, "tolist") else prefix_ids.tolist()
    if not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError("prefix_ids must be a non-empty list of token ids (one row)")
    once = GenerationConfig(max_new_tokens=1, cache_implementation=cfg.cache_implementation,
                            cache_config=cfg.cache_config, pad_token_id=cfg.pad_token_id,
                            eos_token_id=cfg.eos_token_id)
    out = generate(params, init_state(model, [ids], once, cache_dtype=cache_dtype), once,
                   layout=layout)
    # the prefill wrote the prefix; the one new token was chosen but never fed back
    return CachedPrefix(model=model, tokens=(tuple(ids),), cached=(len(ids),),
                        cache=out.state.cache)
