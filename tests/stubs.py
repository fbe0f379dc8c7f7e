"""Stub models honouring the model contract with exactly known logits (t5x-style tests), and a
stub tokenizer for the streamer tests."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import KVCache


class StubOutput(NamedTuple):
    logits: jax.Array
    hidden: jax.Array
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class BigramStub:
    """Next-token logits depend only on the last token: logits = params["table"][token].

    params: {"table": float32 [V, V]}. The cache is a 1-layer dummy that is written like a
    real one, so rollback and ragged lengths exercise the same paths.
    """

    vocab_size: int
    pad_token_id: int | None = None
    eos_token_id: tuple = ()

    @property
    def config(self):
        return self

    def init_cache(self, batch, max_len, dtype=jnp.float32, kind="static"):
        return KVCache.init(num_layers=1, batch=batch, max_len=max_len, num_kv_heads=1,
                            head_dim=1, dtype=dtype)

    def __call__(self, params, tokens, positions, cache, *, exit_layer=None, logits_index=None):
        values = tokens.astype(jnp.float32)[..., None, None]  # [B, S, 1, 1]
        cache = cache.update(0, values, values, positions).with_length(positions[:, -1] + 1)
        if logits_index is not None:
            tokens = jnp.take_along_axis(tokens, logits_index, axis=1)  # [B, S']
        logits = params["table"][tokens]  # [B, S', V]
        return StubOutput(logits=logits, hidden=logits, cache=cache)


def random_table(vocab: int, seed: int = 0, scale: float = 2.0) -> dict:
    rng = np.random.default_rng(seed)
    return {"table": jnp.asarray(rng.normal(size=(vocab, vocab)).astype(np.float32) * scale)}


class LetterTokenizer:
    """Token i decodes as the letter chr(97 + i); letters encode back modulo VOCAB (16 ids)."""

    VOCAB = 16
    eos_token_id = None
    pad_token_id = None
    chat_template = None

    @staticmethod
    def decode(ids, **_):
        return "".join(chr(97 + int(i)) for i in ids)

    @staticmethod
    def encode(text, add_special_tokens=True):
        return [(ord(c) - 97) % LetterTokenizer.VOCAB for c in text]
