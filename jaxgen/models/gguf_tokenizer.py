"""Builds a `Tokenizer` from a GGUF file's tokenizer.ggml.* metadata (GPT-2 style BPE).

The pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` name. For "smollm" (and the
other names llama.cpp maps to the same regexes: starcoder, refact, command-r, codeshell,
exaone) that is: every digit its own piece (`\\p{N}`), then GPT-2's byte-level regex. In
`tokenizers` terms: Sequence([Digits(individual_digits=True), ByteLevel(use_regex=True)]) -
the same pre-tokenizer HF's SmolLM2 tokenizer.json declares. Plain "gpt2"/"default" use only
the byte-level regex. Special tokens are those with token_type CONTROL (3) or USER_DEFINED (4).

Every tokenizer.* value is checked before the tokenizer is built: a missing or mistyped key,
a merge that is not two vocabulary tokens "a b" whose concatenation is one too, or a
token_type list of another length than the tokens is a ValueError naming the file and the key.

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
from jaxgen.models.tokenizer_files import short_repr

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
    tokens = _strings(reader, "tokenizer.ggml.tokens", path, required=True)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _merges(_strings(reader, "tokenizer.ggml.merges", path), vocab, path)
    types = _token_types(reader, len(tokens), path)

    def token(key):  # an id outside the vocabulary names no token
        index = _typed(reader, f"tokenizer.ggml.{key}", int, "a token id (integer)", path)
        return None if index is None or not 0 <= index < len(tokens) else tokens[index]

    named = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
             "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    flags = {name: _typed(reader, f"tokenizer.ggml.{name}", bool, "true or false", path)
             for name in ("add_bos_token", "add_eos_token")}
    template = _typed(reader, "tokenizer.chat_template", str, "a string", path)
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as err:  # what the checks above do not foresee
        raise ValueError(f"{path}: tokenizer.ggml.tokens / tokenizer.ggml.merges do not make "
                         f"a BPE tokenizer ({err})") from None
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types)
               if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return Tokenizer(backend, special_tokens=named, additional_special_tokens=special,
                     chat_template=template,
                     **{name: bool(value) for name, value in flags.items()})


def _typed(reader, key: str, kind: type, allowed: str, path: str):
    """Metadata `key` when absent (None) or of type `kind` (an int is not a bool, nor the
    other way round); else ValueError naming the file and the key."""
    value = field(reader, key)
    if value is None or (isinstance(value, kind) and (kind is bool) == isinstance(value, bool)):
        return value
    raise ValueError(f"{path}: {key}={short_repr(value)}; allowed: {allowed}")


def _strings(reader, key: str, path: str, required: bool = False) -> list[str]:
    """Metadata `key` as a list of strings ([] when absent and not `required`)."""
    value = field(reader, key)
    if value is None:
        if required:
            raise ValueError(f"{path}: missing metadata {key} (the vocabulary); allowed: an "
                             f"array of strings")
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{path}: {key}={short_repr(value)}; allowed: an array of strings")
    return value


def _merges(merges: list[str], vocab: dict[str, int], path: str) -> list[tuple[str, str]]:
    """Each merge "a b" as (a, b): a, b and a + b are vocabulary tokens."""
    pairs = []
    for i, merge in enumerate(merges):
        pair = tuple(merge.split(" ", 1))
        if len(pair) != 2 or not all(pair):
            raise ValueError(f"{path}: tokenizer.ggml.merges[{i}]={merge!r}; allowed: two "
                             f"tokens separated by one space")
        for part in (*pair, pair[0] + pair[1]):
            if part not in vocab:
                raise ValueError(f"{path}: tokenizer.ggml.merges[{i}]={merge!r}: {part!r} is "
                                 f"not in tokenizer.ggml.tokens; allowed: a merge of two "
                                 f"vocabulary tokens whose concatenation is one too")
        pairs.append(pair)
    return pairs


def _token_types(reader, count: int, path: str) -> list[int]:
    """tokenizer.ggml.token_type: one integer per token (absent: all NORMAL, 1)."""
    key = "tokenizer.ggml.token_type"
    types = field(reader, key)
    if types is None:
        return [1] * count
    if not isinstance(types, list) or len(types) != count or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise ValueError(f"{path}: {key}={short_repr(types)}; allowed: an array of {count} "
                         f"integers (one per entry of tokenizer.ggml.tokens)")
    return types


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """Tokenizer from a GGUF file path."""
    return gguf_tokenizer(open_gguf(path), path)
