"""`generate_batch`: many prompts through the continuous-batching engine, one result each.

Hugging Face's `generate_batch` in spirit: the prompts are queued on an Engine with `slots`
rows, each decoded as a slot frees up, and the results come back in the prompts' order (as
jaxgen.generate_ids' rows: prompt + new ids). A short answer frees its slot for the next
prompt instead of waiting for the batch's longest.

Example:
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> rows = generate_batch(model, params, [[1, 2, 3], [4, 5], [6]], slots=2,
    ...                       max_new_tokens=3)
    >>> [len(row) for row in rows]
    [6, 5, 4]
"""
from __future__ import annotations

from jaxgen.api.generate import default_config
from jaxgen.config.generation import GenerationConfig
from jaxgen.serving.admission import slot_length
from jaxgen.serving.engine import Engine


def generate_batch(model, params, prompts, cfg: GenerationConfig | None = None, *,
                   slots: int = 8, max_len: int | None = None, chunk_size: int = 8,
                   keys=None, layout: str = "auto", timeout: float | None = None,
                   **overrides) -> list[list[int]]:
    """Prompt + generated ids per prompt, in order. prompts: lists of token ids. keys:
    None, or one PRNG key per prompt (a sampled row equals its solo generate_ids call with
    that key). max_len: each slot's buffer (default: the longest prompt's bucket + the
    budget's bucket, at most the model's positions). timeout: seconds to wait for each
    result (None: no limit)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate_batch: `prompts` must be a non-empty list of token-id lists")
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"generate_batch: `keys` holds {len(keys)} keys for {len(prompts)} "
                         f"prompts; pass one per prompt")
    cfg = default_config(model, cfg, **overrides)
    if max_len is None:
        budget = cfg.max_new_tokens or max(int(cfg.max_length) - 1, 1)
        max_len = slot_length(model, max(len(p) for p in prompts), int(budget))
    engine = Engine(model, params, cfg, slots=slots, max_len=max_len, chunk_size=chunk_size,
                    max_waiting=len(prompts), layout=layout)
    try:
        handles = [engine.submit(prompt, **({} if keys is None else {"key": keys[i]}))
                   for i, prompt in enumerate(prompts)]
        results = [handle.result(timeout).ids for handle in handles]
    except BaseException:
        engine.close(cancel=True)
        raise
    engine.close()
    return results


__all__ = ["generate_batch"]
