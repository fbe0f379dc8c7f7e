"""A tiny random Llama and a byte-level tokenizer for examples, doctests and quick
experiments (no files needed).

Example:
    >>> from jaxgen.models import tiny_llama, tiny_tokenizer
    >>> model, params = tiny_llama()
    >>> model.vocab_size, params["embed"].shape
    (32, (32, 16))
    >>> tok = tiny_tokenizer()
    >>> tok.decode(tok.encode("a stop")), tok.eos_token_id
    ('a stop', 256)
"""
from __future__ import annotations

import jax
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jaxgen.models.llama import Llama, LlamaConfig
from jaxgen.models.tokenizer import Tokenizer

TINY_SHAPES = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=8)
TINY_VOCAB = 261  # tiny_tokenizer(): 256 bytes, "</s>", "st", "op", "th", "the"


def tiny_llama(seed: int = 0, **overrides) -> tuple[Llama, dict]:
    """(model, params): a one-layer, 32-token Llama with random weights. overrides:
    LlamaConfig fields (e.g. num_layers=2, vocab_size=TINY_VOCAB to pair it with
    tiny_tokenizer)."""
    model = Llama(LlamaConfig(**{**TINY_SHAPES, **overrides}))
    return model, model.init_params(jax.random.key(seed))


def tiny_tokenizer(chat_template: str | None = None) -> Tokenizer:
    """A byte-level BPE over the 256 bytes with four merges ("st", "op", "th", "the") and "</s>"
    (id 256) as EOS: every text encodes, and ids < TINY_VOCAB decode."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["</s>"] = len(vocab)
    merges = [("s", "t"), ("o", "p"), ("t", "h"), ("th", "e")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"}, chat_template=chat_template)
