"""A prompt's text to token ids for the server: bounded by its characters first, then
tokenized without holding the GIL.

Tokenizing a huge text holds the caller for seconds (and `tokenizers.Tokenizer.encode` keeps
Python's GIL all that time, stalling the event loop and every other client), only to learn
the prompt is past the context. `chars_per_token(tokenizer)` is the most characters of a
prompt one token can stand for, so a text longer than that times the tokens allowed is
refused before it is tokenized; `encode(tokenizer, text)` tokenizes through `encode_batch`,
which releases the GIL.

Why the bound holds: a token stands for at most `longest` characters of the text the
tokenizer's model splits (its longest vocabulary or added token string; a byte-level token
has one character per byte, and a character is at least one byte). That bounds the prompt's
characters only when none of them is dropped or folded into a token that stands for
unboundedly many, so the bound is given only for a BPE model that covers every byte (a
byte-level pre-tokenizer, or byte fallback) behind pre-tokenizers that remove nothing and
normalizers that map a character to one or more (Prepend, a one-character Replace, NFD,
NFKD, Lowercase) or compose at most COMPOSED_CODE_POINTS code points into one (NFC, NFKC),
and without added tokens that take in the whitespace around them (lstrip / rstrip /
single_word: one token for any run of spaces).
Any other tokenizer gets None: its prompts are only counted by tokenizing them.

Example (the tiny byte-level tokenizer: its longest token is "</s>"):
    >>> from jaxgen.models import tiny_tokenizer
    >>> tok = tiny_tokenizer()
    >>> chars_per_token(tok), encode(tok, "the") == tok.encode("the")
    (4, True)
"""
from __future__ import annotations

import json

COMPOSED_CODE_POINTS = 4  # Unicode's longest canonical decomposition (e.g. U+1F82)
# normalizers that drop nothing: how many input characters one output character may hold
_NORMALIZER_FOLDS = {"Prepend": 1, "NFD": 1, "NFKD": 1, "Lowercase": 1,
                     "NFC": COMPOSED_CODE_POINTS, "NFKC": COMPOSED_CODE_POINTS}
# pre-tokenizers that only split (unless their behavior is "Removed") or map 1:1
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation",
                           "UnicodeScripts"}


def _steps(component, key: str) -> list | None:
    """A normalizer / pre-tokenizer as its list of steps (Sequences flattened); None when it
    cannot be read."""
    if component is None:
        return []
    try:
        state = json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    flat, todo = [], [state]
    while todo:
        step = todo.pop(0)
        if step.get("type") == "Sequence":
            todo[:0] = step.get(key, [])
        else:
            flat.append(step)
    return flat


def _fold(normalizer) -> int | None:
    """Input characters one normalized character may stand for; None: unbounded."""
    steps = _steps(normalizer, "normalizers")
    if steps is None:
        return None
    fold = 1
    for step in steps:
        kind = step.get("type")
        if kind == "Replace":
            pattern = (step.get("pattern") or {}).get("String")
            if pattern is None or len(pattern) != 1 or not step.get("content"):
                return None
        elif kind in _NORMALIZER_FOLDS:
            fold *= _NORMALIZER_FOLDS[kind]
        else:
            return None
    return fold


def _covers_every_byte(backend, pre_steps: list) -> bool:
    """Whether the BPE model has a token for every byte of any text (no unknown token, no
    dropped character)."""
    if type(backend.model).__name__ != "BPE":
        return False
    vocab = backend.get_vocab(with_added_tokens=False)
    if any(step.get("type") == "ByteLevel" for step in pre_steps):
        from tokenizers import pre_tokenizers

        return all(char in vocab for char in pre_tokenizers.ByteLevel.alphabet())
    return bool(getattr(backend.model, "byte_fallback", False)) and all(
        f"<0x{byte:02X}>" in vocab for byte in range(256))


def _absorbs_spaces(backend) -> bool:
    """Whether an added token takes in the whitespace around it (lstrip / rstrip /
    single_word): one such token stands for any number of characters."""
    added = getattr(backend, "get_added_tokens_decoder", dict)()
    return any(getattr(token, "lstrip", False) or getattr(token, "rstrip", False)
               or getattr(token, "single_word", False) for token in added.values())


def chars_per_token(tokenizer) -> int | None:
    """The most characters of a prompt one token can stand for; None when the tokenizer gives
    no such bound (see the module's docstring)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return None
    pre_steps = _steps(backend.pre_tokenizer, "pretokenizers")
    if pre_steps is None or any(
            step.get("type") not in _KEEPING_PRE_TOKENIZERS
            or str(step.get("behavior", "")).lower() == "removed" for step in pre_steps):
        return None
    fold = _fold(backend.normalizer)
    if fold is None or not _covers_every_byte(backend, pre_steps) or _absorbs_spaces(backend):
        return None
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)),
                  default=1)
    return max(longest, 1) * fold


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list:
    """tokenizer.encode(text), through `encode_batch` where the backend has it (it releases
    the GIL, so other threads and the event loop run meanwhile)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return list(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


__all__ = ["COMPOSED_CODE_POINTS", "chars_per_token", "encode"]
