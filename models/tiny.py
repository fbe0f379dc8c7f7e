"""A tiny random Llama for examples, doctests and quick experiments (no files needed).

Example:
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> model.vocab_size, params["embed"].shape
    (32, (32, 16))
"""
from __future__ import annotations

import jax

from .llama import Llama, LlamaConfig

TINY_SHAPES = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=8)


def tiny_llama(seed: int = 0, **overrides) -> tuple[Llama, dict]:
    """(model, params): a one-layer, 32-token Llama with random weights. overrides:
    LlamaConfig fields (e.g. num_layers=2, vocab_size=64)."""
    model = Llama(LlamaConfig(**{**TINY_SHAPES, **overrides}))
    return model, model.init_params(jax.random.key(seed))
