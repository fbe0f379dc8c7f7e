"""Builds a `Tokenizer` from a GGUF file's tokenizer.ggml.* metadata (GPT-2 style BPE).

The pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` name. For "smollm" (and the
other names llama.cpp maps to the same regexes: starcoder, refact, command-r, codeshell,
exaone) that is: every digit its own piece (`\\p{N}`), then GPT-2's byte-level regex. In
`tokenizers` terms: Sequence([Digits(individual_digits=True), ByteLevel(use_regex=True)]) -
the same pre-tokenizer HF's SmolLM2 tokenizer.json declares. Plain "gpt2"/"default" use only
the byte-level regex. Special tokens are those with token_type CONTROL (3) or USER_DEFINED (4).

Example (illustration: reading the embedded SmolLM2 vocabulary takes a few seconds):
    >>> from jaxgen.models.embedded import DEFAULT_MODEL, embedded_path
    >>> tok = load_gguf_tokenizer(embedded_path(DEFAULT_MODEL))   # doctest: +SKIP
    >>> tok.encode("<|im_start|>user")                            # doctest: +SKIP
    [1, 4093]
"""
from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from jaxgen.models.gguf_checkpoint import field, open_gguf
from jaxgen.models.tokenizer import Tokenizer

_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_PLAIN_PRE = ("gpt2", "gpt-2", "default")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def gguf_tokenizer(reader, path: str = "<gguf>") -> Tokenizer:
    """Tokenizer from an open GGUF reader."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: unsupported GGUF tokenizer model {kind!r} (only 'gpt2' BPE)")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _PLAIN_PRE:
        pre_tokenizer = byte_level
    else:
        raise ValueError(f"{path}: unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(_DIGIT_SPLIT_PRE + _PLAIN_PRE)}")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types)
               if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        index = field(reader, f"tokenizer.ggml.{key}")
        return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]

    named = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
             "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    return Tokenizer(backend, special_tokens=named, additional_special_tokens=special,
                     chat_template=field(reader, "tokenizer.chat_template"),
                     add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
                     add_eos_token=bool(field(reader, "tokenizer.ggml.add_eos_token", False)))


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """Tokenizer from a GGUF file path."""
    return gguf_tokenizer(open_gguf(path), path)
