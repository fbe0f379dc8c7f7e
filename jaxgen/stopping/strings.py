"""Stop strings with Hugging Face's `StopStringCriteria` semantics, checked on the device.

A row stops when one of the stop strings occurs in the text of its last tokens and *ends
inside the newest token*: it may span token boundaries and partial tokens at both ends
("st" + "opera" matches "stop"), but a match that lies entirely in earlier tokens does not
fire again. Matching runs over the tokens' byte strings for byte-level / byte-fallback
vocabularies (stop strings are UTF-8 encoded) and over their text otherwise, and may reach
back into the prompt, as in HF.

Host side (once per tokenizer and set of strings, cached), for every vocabulary token t and
stop string s:
    end[t, s, k]    t can hold the *end* of s, with the k last characters of s in t
                    (k = len(s): s lies wholly inside t);
    valid[t, s, m]  t can sit right before m already-matched trailing characters of s
                    (t's text ends with s[:len(s)-m], possibly running off the start of s);
    length[t]       the length of t's text.
Only tokens with some entry get a row in the compact `end` / `valid` tables; `row[t]` maps a
token to it (row 0 is all-false).

Device side, per step: walk back from the newest token over the last `window` tokens
(window = the longest stop string: at least one character per token) keeping the set of
matched-suffix lengths m as a bool vector [B, S, W]; a stop string fires as soon as some m
reaches len(s). The walk is a loop in the program (its size does not grow with the strings)
that ends as soon as no partial match is alive: usually after a token or two, at most window
steps of S x W boolean ops per row, negligible next to a decode step.

Example (a byte-level BPE that splits "stop" as "st" + "op"):
    >>> import jax.numpy as jnp
    >>> from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    >>> vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    >>> vocab["st"], vocab["op"] = len(vocab), len(vocab) + 1
    >>> tok = Tokenizer(models.BPE(vocab, [("s", "t"), ("o", "p")]))
    >>> tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    >>> tok.decoder = decoders.ByteLevel()
    >>> ids = tok.encode("a stop").ids              # a, Ġ, st, op
    >>> tables = build_stop_tables(tok, ["stop"])
    >>> stop_string_hit(tables, jnp.array([ids]), jnp.array([4])).tolist()   # ends in "op"
    [True]
    >>> stop_string_hit(tables, jnp.array([ids]), jnp.array([3])).tolist()   # "a st" only
    [False]
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config.fields import check_stop_strings

# (id(tokenizer), strings, vocab) -> (tokenizer, host tables), least recently used first;
# at most TABLE_CACHE_SIZE entries (each holds two [vocab] arrays).
_TABLE_CACHE: dict = {}
TABLE_CACHE_SIZE = 16
# id(tokenizer) -> (tokenizer, token_texts(tokenizer)): the vocabulary pass, once per tokenizer.
_TEXTS_CACHE: dict = {}
TEXTS_CACHE_SIZE = 4
# "<0xHH>" byte-fallback tokens: what the tokenizers decoder parses as a byte (two hex digits,
# or Rust's optional "+" and one digit); anything else ("<0x 1>") is text.
_BYTE_DIGITS = re.compile(r"\+?[0-9A-Fa-f]{1,2}")


# ------------------------------------------------------------------- token strings
def _byte_level_alphabet() -> dict[str, int]:
    """The printable-character alias of every byte used by byte-level BPE (GPT-2 style):
    printable Latin-1 bytes stand for themselves, the others are shifted to 256 + n."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    alias, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            alias[chr(byte)] = byte
        else:
            alias[chr(256 + shift)] = byte
            shift += 1
    return alias


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` behind our wrapper (`.backend`), HF's (`.backend_tokenizer`),
    or the object itself."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    for name in ("backend", "backend_tokenizer"):
        inner = getattr(tokenizer, name, None)
        if isinstance(inner, tokenizers.Tokenizer):
            return inner
    return None


def _has_type(node, kind: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


def matching_mode(tokenizer) -> str | None:
    """"byte_level", "byte_fallback" or None (plain text), from the tokenizer's decoder."""
    backend = _backend(tokenizer)
    if backend is None or backend.decoder is None:
        return None
    if type(backend.decoder).__name__ == "ByteLevel":
        return "byte_level"
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return None
    if _has_type(decoder, "ByteFallback"):
        return "byte_fallback"
    if _has_type(decoder, "ByteLevel"):
        return "byte_level"
    return None


def _vocab(tokenizer) -> dict[str, int]:
    backend = _backend(tokenizer)
    if hasattr(tokenizer, "get_vocab") and tokenizer is not backend:
        return dict(tokenizer.get_vocab())
    return dict(backend.get_vocab(with_added_tokens=True))


def token_texts(tokenizer) -> tuple[dict[int, str | bytes], str | None]:
    """{token id: the text (or bytes) it contributes to a decoded string}, and the mode.

    Byte-level tokens map through the byte alphabet, "<0xNN>" byte-fallback tokens are their
    byte; anything else is decoded after a fixed prefix that is then cut off (so prefix-space
    rules such as SentencePiece's leading "▁" come out as in running text).
    """
    mode = matching_mode(tokenizer)
    backend = _backend(tokenizer)
    alphabet = _byte_level_alphabet() if mode == "byte_level" else None
    prefix = "abcdef"
    prefix_ids = None
    out: dict[int, str | bytes] = {}
    for token, index in _vocab(tokenizer).items():
        text = None
        if mode == "byte_level" and all(ch in alphabet for ch in token):
            text = bytes(alphabet[ch] for ch in token)
        elif (mode == "byte_fallback" and len(token) == 6 and token.startswith("<0x")
              and token.endswith(">") and _BYTE_DIGITS.fullmatch(token[3:5])):
            try:
                text = bytes([int(token[3:5], 16)])
            except ValueError:
                text = None
        if text is None:
            if prefix_ids is None:
                prefix_ids = _encode_plain(tokenizer, backend, prefix)
            decoded = _decode_plain(tokenizer, backend, prefix_ids + [index])
            cut = decoded.find(prefix)
            text = decoded[cut + len(prefix):] if cut >= 0 else decoded
            if mode is not None:
                text = text.encode("utf-8")
        out[int(index)] = text
    return out, mode


def _encode_plain(tokenizer, backend, text: str) -> list[int]:
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode_plain(tokenizer, backend, ids: list[int]) -> str:
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False)


# -------------------------------------------------------------------------- tables
def _end_overlaps(token, stop) -> list[int]:
    """k such that `stop`'s last k characters end inside `token` and either fill `stop`
    (k = len(stop)) or start at the token's first character."""
    out = []
    last = stop[-1:]
    i = token.find(last)
    while i >= 0:
        k = min(i + 1, len(stop))
        if token[i + 1 - k:i + 1] == stop[len(stop) - k:]:
            out.append(k)
        i = token.find(last, i + 1)
    return out


def _valid_positions(token, stop) -> list[int]:
    """m in 1..len(stop)-1 such that `token` can precede m matched trailing characters:
    its text ends with stop[:len(stop)-m] (all of it, or its last len(token) characters)."""
    out = []
    for m in range(1, len(stop)):
        end = len(stop) - m
        chunk = stop[max(0, end - len(token)):end]
        if token.endswith(chunk):
            out.append(m)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopStringTables:
    """Device tables for `stop_string_hit` (see the module docstring).

    row     int32 [Vt]        compact row of each token id (Vt = vocab + 1; the last id is a
                              dummy for out-of-range / before-the-start positions)
    length  int32 [Vt]        length of each token's text
    end     bool  [R, S, W]   end overlaps k (W > the longest stop string)
    valid   bool  [R, S, W]   continuation positions m
    target  int32 [S]         stop-string lengths
    reach   int32 []          tokens inspected per step (the longest stop string)
    strings, window           static: the stop strings (() in a program's state, see
                              `program_tables`), and the bucket of `reach` (W - 1)

    R, S and W are padded to buckets (`table_bucket`) with all-false rows, strings and
    columns, and `reach` is dynamic: new stop strings of the same buckets reuse a compiled
    program, with the same hits.
    """

    row: jax.Array
    length: jax.Array
    end: jax.Array
    valid: jax.Array
    target: jax.Array
    reach: jax.Array
    strings: tuple = dataclasses.field(metadata=dict(static=True))
    window: int = dataclasses.field(metadata=dict(static=True))


def table_bucket(n: int, least: int) -> int:
    """The padded size of a stop-table axis: the smallest power of two >= n, at least `least`.

    >>> [table_bucket(n, 8) for n in (1, 8, 9, 100)]
    [8, 8, 16, 128]
    """
    return max(int(least), 1 << max(int(n) - 1, 0).bit_length())


def program_tables(tables: StopStringTables | None) -> StopStringTables | None:
    """The tables as a compiled program takes them: without the strings (static), so a
    program is keyed on the buckets alone."""
    return None if tables is None else dataclasses.replace(tables, strings=())


def _cached_texts(tokenizer):
    """token_texts(tokenizer), computed once per tokenizer (the last few are kept)."""
    cached = _TEXTS_CACHE.pop(id(tokenizer), None)
    if cached is None or cached[0] is not tokenizer:
        cached = (tokenizer, token_texts(tokenizer))
    _TEXTS_CACHE[id(tokenizer)] = cached
    while len(_TEXTS_CACHE) > TEXTS_CACHE_SIZE:
        _TEXTS_CACHE.pop(next(iter(_TEXTS_CACHE)))
    return cached[1]


def _host_tables(tokenizer, strings: tuple[str, ...], vocab_size: int):
    texts, mode = _cached_texts(tokenizer)
    stops = [s.encode("utf-8") if mode is not None else s for s in strings]
    width = max(len(s) for s in stops) + 1
    table_rows = max(vocab_size, max(texts) + 1) + 1
    row = np.zeros((table_rows,), np.int32)
    length = np.zeros((table_rows,), np.int32)
    ends, valids = [np.zeros((len(stops), width), bool)], [np.zeros((len(stops), width), bool)]
    any_end = np.zeros((len(stops),), bool)
    for index, text in texts.items():
        length[index] = len(text)
        end = np.zeros((len(stops), width), bool)
        valid = np.zeros((len(stops), width), bool)
        for s, stop in enumerate(stops):
            for k in _end_overlaps(text, stop):
                end[s, k] = True
            for m in _valid_positions(text, stop):
                valid[s, m] = True
        if end.any() or valid.any():
            any_end |= end.any(axis=1)
            row[index] = len(ends)
            ends.append(end)
            valids.append(valid)
    if not any_end.all():
        missing = [strings[s] for s in np.flatnonzero(~any_end)]
        raise ValueError(f"`stop_strings`: no token of the vocabulary can end {missing!r}; the "
                         f"string(s) hold characters the tokenizer cannot produce")
    target = np.array([len(s) for s in stops], np.int32)
    return _padded(row, length, np.stack(ends), np.stack(valids), target, width - 1)


# Least bucket per axis of the padded tables: compact rows, strings, columns (W).
LEAST_ROWS, LEAST_STRINGS, LEAST_WIDTH = 64, 4, 8


def _padded(row, length, end, valid, target, reach):
    """The host tables with R, S and W padded to their buckets (all-false entries; a padded
    string's target is W, which no state reaches)."""
    rows, strings, width = end.shape
    shape = (table_bucket(rows, LEAST_ROWS), table_bucket(strings, LEAST_STRINGS),
             table_bucket(width, LEAST_WIDTH))
    big_end, big_valid = np.zeros(shape, bool), np.zeros(shape, bool)  # [R, S, W] each
    big_end[:rows, :strings, :width] = end
    big_valid[:rows, :strings, :width] = valid
    big_target = np.full((shape[1],), shape[2], np.int32)  # [S]
    big_target[:strings] = target
    return row, length, big_end, big_valid, big_target, reach


def build_stop_tables(tokenizer, stop_strings: str | Sequence[str],
                      vocab_size: int = 0) -> StopStringTables:
    """Precomputes the device tables for `stop_strings` from the tokenizer's vocabulary.

    vocab_size: the model's vocabulary (ids up to it are looked up; larger ones never match).
    The host work (a pass over the vocabulary) is cached per tokenizer and strings.
    """
    if tokenizer is None:
        raise ValueError("`stop_strings` needs a tokenizer to map strings to tokens: pass "
                         "tokenizer= to init_state / generate_ids / generate_text")
    strings = check_stop_strings(stop_strings)
    key = (id(tokenizer), strings, int(vocab_size))
    cached = _TABLE_CACHE.get(key)
    if cached is None or cached[0] is not tokenizer:
        cached = (tokenizer, _host_tables(tokenizer, strings, int(vocab_size)))
        _TABLE_CACHE[key] = cached
        while len(_TABLE_CACHE) > TABLE_CACHE_SIZE:  # the oldest entry goes
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
    else:
        _TABLE_CACHE[key] = _TABLE_CACHE.pop(key)  # most recently used: last
    row, length, end, valid, target, reach = cached[1]
    put = jax.device_put  # host arrays over as they are: no program compiles
    return StopStringTables(row=put(row), length=put(length), end=put(end), valid=put(valid),
                            target=put(target), reach=put(np.int32(reach)), strings=strings,
                            window=end.shape[-1] - 1)


# --------------------------------------------------------------------------- check
def stop_string_hit(tables: StopStringTables, tokens: jax.Array, length: jax.Array) -> jax.Array:
    """bool [B]: a stop string ends inside the row's newest token tokens[b, length[b] - 1].

    tokens int32 [B, T]; length int32 [B] (real tokens, the newest included).
    """
    dummy = tables.row.shape[0] - 1
    width = tables.end.shape[-1]
    reach = jnp.asarray(tables.reach, jnp.int32)  # [] steps past it look back too far
    back = jnp.arange(tables.window)  # [M]
    index = length[:, None] - 1 - back[None, :]  # [B, M] newest first
    ids = jnp.take_along_axis(tokens, jnp.clip(index, 0, tokens.shape[1] - 1), axis=1)
    ids = jnp.where((index >= 0) & (ids >= 0), jnp.minimum(ids, dummy), dummy)  # [B, M]
    rows = tables.row[ids]  # [B, M]
    lengths = tables.length[ids]  # [B, M]
    m = jnp.arange(width)  # [W]
    target = tables.target[None, :, None]  # [1, S, 1]
    states = tables.end[rows[:, 0]]  # [B, S, W] matched-suffix lengths after the newest token
    matched = jnp.any(states & (m >= target), axis=-1)  # [B, S]

    def more(carry):  # tokens left in the window and some partial match still alive
        j, states, _ = carry
        return (j < tables.window) & (j < reach) & jnp.any(states)

    def back_one(carry):  # extend every live partial match over the token j places back
        j, states, matched = carry
        cont = states & tables.valid[rows[:, j]]  # [B, S, W]
        step = lengths[:, j][:, None, None]  # [B, 1, 1]
        matched |= jnp.any(cont & (m + step >= target), axis=-1)  # [B, S]
        source = m[None, None, :] - step  # [B, 1, W]
        moved = jnp.take_along_axis(cont, jnp.broadcast_to(jnp.clip(source, 0, width - 1),
                                                           cont.shape), axis=-1)
        return j + 1, moved & (source >= 0), matched  # states [B, S, W]

    _, _, matched = jax.lax.while_loop(more, back_one, (jnp.int32(1), states, matched))
    return jnp.any(matched, axis=-1)  # [B]
