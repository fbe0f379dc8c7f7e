"""regex= / json_schema= / choices= compiled to a token automaton for a tokenizer.

The library: `outlines-core` (PyPI, Rust): `Index(regex, Vocabulary)` walks the regex's
DFA over every token's bytes and returns exactly the token-level automaton jaxgen carries
(state x token -> next state, final states); `build_regex_from_schema` turns a JSON schema
into a regex. On SmolLM2's 49,152-token vocabulary it builds a date regex in ~0.25 s and a
nested object schema (340 states, 944k edges) in ~0.6 s on one CPU core
(benchmarks/bench_constraints.py). xgrammar matches tokens at run time with a pushdown
automaton and a host-side bitmask per step (no state x token table to carry on the device);
interegular gives the character FSM only, and walking 49k tokens through it in Python is
minutes for a schema.

Every token's bytes come from `jaxgen.stopping.strings.token_texts` (byte-level BPE through
the byte alphabet, `<0xHH>` byte-fallback tokens as their byte, SentencePiece pieces
decoded in context); special tokens (BOS, EOS, chat markers) are never part of a pattern.
EOS is allowed exactly at the pattern's final states (jaxgen.constraints.automaton).

Compiled automata are cached per (tokenizer, vocabulary size, kind, pattern), the
CACHE_SIZE most recently used. Building is bounded: outlines-core runs in a child process
killed past a time or memory bound (`index_build.py`), and an automaton whose device arrays
would pass MAX_AUTOMATON_BYTES is refused; both raise `ConstraintTooComplex`.

Example (the tiny byte-level tokenizer: "th" + "e" or the merged "the"):
    >>> from jaxgen.models import TINY_VOCAB, tiny_tokenizer
    >>> built = compile_constraint(tiny_tokenizer(), TINY_VOCAB, choices=["the", "a"])
    >>> built.kind, built.states, built.edges        # "t" "h" "e", "th" "e", "the", "a"
    ('choices', 4, 6)
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Sequence

import numpy as np

from jaxgen.constraints.automaton import TokenAutomaton, from_arrays, words_for
from jaxgen.constraints.index_build import ConstraintTooComplex, build_index
from jaxgen.stopping.strings import token_texts

EXTRA = "outlines-core"  # the PyPI package that builds the automata

# JSON-schema keywords whose meaning the compiled regex keeps exactly (annotations are
# ignored; anything else is refused rather than silently dropped by the regex builder).
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "minLength", "maxLength", "pattern", "format", "anyOf", "$ref",
    "$defs", "definitions", "additionalProperties"})
SCHEMA_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment",
                                "default", "examples"})
SCHEMA_FORMATS = ("date", "time", "date-time", "uuid", "email", "uri")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")

# outlines-core 0.2.14's Index drops the edges that leave a final state towards a non-final
# one ("(ab)+" loses its loop: after "ab" only EOS is allowed). So the pattern is compiled
# followed by a sentinel character that a fake token (id = vocab_size, never a model id)
# spells: no state of the pattern itself is final then, every edge is kept, and the pattern's
# final states are exactly those with a sentinel edge into the index's final state.
SENTINEL = "\ufdd0"  # a Unicode noncharacter: no text token ends a pattern with it

# (id(tokenizer), vocab size, kind, pattern) -> (tokenizer, CompiledConstraint), least
# recently used first; a server compiles one per request schema, so at most CACHE_SIZE.
_CACHE: dict = {}
CACHE_SIZE = 32
_VOCABULARIES: dict = {}  # (id(tokenizer), vocab size) -> (tokenizer, (Vocabulary, eos))
VOCABULARIES_SIZE = 4
# The automaton's device arrays (the [S, V / 32] allowed-token bits and 8 bytes an edge) may
# hold at most this many bytes: more is refused, naming the states and edges.
MAX_AUTOMATON_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class CompiledConstraint:
    """A compiled pattern: the automaton and what it took (host-side metadata)."""

    automaton: TokenAutomaton
    kind: str  # "regex" | "json_schema" | "choices"
    regex: str  # the regex the automaton recognises
    states: int  # live states (the automaton's arrays are padded to a bucket)
    edges: int
    build_s: float  # seconds to build (0 on a cache hit is not recorded: the first build)


def _outlines():
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        raise ImportError(f"regex= / json_schema= / choices= need the `{EXTRA}` package: "
                          f"pip install {EXTRA}") from None
    return outlines_core, build_regex_from_schema


# ------------------------------------------------------------------- inputs
def choose_pattern(regex=None, json_schema=None, choices=None) -> tuple[str, Any] | None:
    """("regex" | "json_schema" | "choices", value) for the one given, None for none; a
    ValueError for several or for a value of the wrong type."""
    given = [(name, value) for name, value in (("regex", regex), ("json_schema", json_schema),
                                               ("choices", choices)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"pass one constraint, got {' and '.join(n + '=' for n, _ in given)} "
                         f"(allowed: regex=, json_schema= or choices=)")
    name, value = given[0]
    if name == "regex" and (not isinstance(value, str) or not value):
        raise ValueError(f"`regex` must be a non-empty string, got {value!r}")
    if name == "choices":
        if isinstance(value, str) or not isinstance(value, Sequence) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise ValueError(f"`choices` must be a non-empty list of non-empty strings, got "
                             f"{value!r}")
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise ValueError(f"`json_schema` is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"`json_schema` must be a dict (or its JSON text), got "
                             f"{type(value).__name__}")
        check_schema(value)
    return name, value


def check_schema(schema: dict, where: str = "#") -> None:
    """ValueError naming the first keyword the compiler would not honour, and the allowed
    ones (JSON-schema keywords the regex drops silently, e.g. minimum, are refused)."""
    if not isinstance(schema, dict):
        if isinstance(schema, bool):
            return
        raise ValueError(f"`json_schema` at {where}: a schema must be an object, got "
                         f"{schema!r}")
    for key, value in schema.items():
        if key in SCHEMA_ANNOTATIONS:
            continue
        if key not in SCHEMA_KEYWORDS:
            raise ValueError(f"`json_schema` at {where}: keyword {key!r} is not supported "
                             f"(allowed: {', '.join(sorted(SCHEMA_KEYWORDS))}; annotations "
                             f"such as title/description are ignored)")
        if key == "format" and value not in SCHEMA_FORMATS:
            raise ValueError(f"`json_schema` at {where}: format {value!r} is not supported "
                             f"(allowed: {', '.join(SCHEMA_FORMATS)})")
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}/{key}/{name}")
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{key}/{i}")
        elif key in _SUBSCHEMAS and isinstance(value, (dict, bool)):
            check_schema(value, f"{where}/{key}")


def escape_literal(text: str) -> str:
    """text as a regex that matches it literally (every ASCII punctuation escaped).

    >>> print(escape_literal("a.b (c)?"))
    a\\.b\\ \\(c\\)\\?
    """
    return "".join("\\" + ch if (ch.isascii() and not ch.isalnum() and ch != "_"
                                 and ch.isprintable()) else ch for ch in text)


def pattern_regex(kind: str, value) -> str:
    """The regex for one constraint (JSON schemas through outlines-core)."""
    if kind == "regex":
        return value
    if kind == "choices":
        return "(" + "|".join(escape_literal(choice) for choice in value) + ")"
    _, build_regex_from_schema = _outlines()
    try:
        return build_regex_from_schema(json.dumps(value))
    except Exception as error:  # outlines-core raises ValueError / its own errors
        raise ValueError(f"`json_schema` cannot be compiled: {error}") from None


# ------------------------------------------------------------------- vocabulary
def _special_ids(tokenizer) -> set[int]:
    ids = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ()))
    backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "backend_tokenizer",
                                                             None) or tokenizer
    decoder = getattr(backend, "get_added_tokens_decoder", None)
    if callable(decoder):
        ids.update(int(i) for i, added in decoder().items() if getattr(added, "special", False))
    return ids


def tokenizer_eos(tokenizer) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    return None if eos is None else int(eos)


def _vocabulary(tokenizer, vocab_size: int):
    """outlines-core's Vocabulary of the tokenizer's text tokens (ids < vocab_size), cached
    per tokenizer object (a strong reference keeps its id from being reused)."""
    key = (id(tokenizer), vocab_size)
    if key in _VOCABULARIES and _VOCABULARIES[key][0] is tokenizer:
        _VOCABULARIES[key] = _VOCABULARIES.pop(key)  # most recently used: last
        return _VOCABULARIES[key][1]
    outlines_core, _ = _outlines()
    texts, _ = token_texts(tokenizer)
    special = _special_ids(tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for index, text in texts.items():
        if index in special or index >= vocab_size:
            continue
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if data:
            by_bytes.setdefault(data, []).append(int(index))
    eos = tokenizer_eos(tokenizer)
    if eos is None:  # outlines-core needs an id it can reserve; one no text token has
        eos = max(special) if special else vocab_size - 1
    by_bytes.setdefault(SENTINEL.encode("utf-8"), []).append(int(vocab_size))
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    _VOCABULARIES[key] = (tokenizer, (vocabulary, eos))
    while len(_VOCABULARIES) > VOCABULARIES_SIZE:  # the least recently used goes
        _VOCABULARIES.pop(next(iter(_VOCABULARIES)))
    return vocabulary, eos


# ------------------------------------------------------------------- building
def _live_states(sources: np.ndarray, targets: np.ndarray, finals: np.ndarray,
                 num_states: int) -> np.ndarray:
    """bool [S]: states from which a final state can be reached."""
    order = np.argsort(targets, kind="stable")
    by_target = sources[order]
    starts = np.searchsorted(targets[order], np.arange(num_states + 1))
    live = np.zeros((num_states,), bool)
    live[finals] = True
    frontier = list(np.flatnonzero(live))
    while frontier:
        state = frontier.pop()
        for source in np.unique(by_target[starts[state]:starts[state + 1]]):
            if not live[source]:
                live[source] = True
                frontier.append(int(source))
    return live


def automaton_from_index(index, vocab_size: int, eos: int,
                         kind: str = "regex") -> tuple[TokenAutomaton, int, int]:
    """(automaton, live states, edges) from the outlines-core Index of "(?:pattern)" +
    SENTINEL: states renumbered densely; final = a sentinel edge (token id vocab_size) into
    the index's final state; the sentinel and EOS edges dropped (EOS is allowed by the final
    flags); states that cannot reach a final state pruned. ValueError when the start state
    cannot reach one."""
    transitions = index.get_transitions()
    initial = index.get_initial_state()
    names = sorted(set(transitions) | {initial} | set(index.get_final_states())
                   | {n for row in transitions.values() for n in row.values()})
    dense = {name: i for i, name in enumerate(names)}
    count = sum(len(row) for row in transitions.values())
    sources = np.empty((count,), np.int64)
    tokens = np.empty((count,), np.int64)
    targets = np.empty((count,), np.int64)
    at = 0
    for state, row in transitions.items():
        n = len(row)
        sources[at:at + n] = dense[state]
        tokens[at:at + n] = np.fromiter(row.keys(), np.int64, n)
        targets[at:at + n] = [dense[t] for t in row.values()]
        at += n
    accepting = np.zeros((len(names),), bool)
    accepting[[dense[f] for f in index.get_final_states()]] = True
    sentinel = tokens == vocab_size
    finals = np.unique(sources[sentinel & accepting[targets]])  # the pattern may end here
    keep = (tokens != eos) & ~sentinel
    sources, tokens, targets = sources[keep], tokens[keep], targets[keep]
    live = _live_states(sources, targets, finals, len(names))
    if not live[dense[initial]]:
        raise ValueError("no token sequence of this tokenizer satisfies the pattern")
    keep = live[sources] & live[targets]
    sources, tokens, targets = sources[keep], tokens[keep], targets[keep]
    needed = len(names) * words_for(vocab_size) * 4 + len(tokens) * 8
    if needed > MAX_AUTOMATON_BYTES:
        raise ConstraintTooComplex(
            f"`{kind}`: its token automaton ({len(names)} states, {len(tokens)} edges) needs "
            f"{needed:,} bytes, past the {MAX_AUTOMATON_BYTES:,} allowed; simplify the "
            f"pattern")
    automaton = from_arrays(sources, tokens, targets, initial=dense[initial], finals=finals,
                            num_states=len(names), vocab_size=vocab_size)
    return automaton, int(live.sum()), int(len(tokens))


def compile_constraint(tokenizer, vocab_size: int, *, regex: str | None = None,
                       json_schema=None, choices: Sequence[str] | None = None
                       ) -> CompiledConstraint:
    """The token automaton of one constraint for `tokenizer` (ids < vocab_size), cached.

    ValueError (before anything compiles) for a missing tokenizer, a regex the compiler
    cannot handle, an unsupported schema keyword or format, a pattern no token sequence can
    satisfy, or (ConstraintTooComplex) an automaton past the build's time or memory bound
    (index_build.py) or past MAX_AUTOMATON_BYTES.
    """
    chosen = choose_pattern(regex, json_schema, choices)
    if chosen is None:
        raise ValueError("compile_constraint needs one of regex=, json_schema=, choices=")
    kind, value = chosen
    if tokenizer is None:
        raise ValueError(f"`{kind}` needs the model's tokenizer to build its token automaton: "
                         f"pass tokenizer= (generate_ids / generate_text)")
    pattern = pattern_regex(kind, value)
    key = (id(tokenizer), int(vocab_size), kind, pattern)
    if key in _CACHE and _CACHE[key][0] is tokenizer:
        _CACHE[key] = _CACHE.pop(key)  # most recently used: last
        return _CACHE[key][1]
    began = time.perf_counter()
    vocabulary, eos = _vocabulary(tokenizer, int(vocab_size))
    _outlines()  # the package is installed (the build runs it in a child process)
    try:
        index = build_index(f"(?:{pattern}){SENTINEL}", vocabulary, kind=kind)
    except ConstraintTooComplex:
        raise
    except ValueError as error:
        message = str(error).split("\n")[0]
        if "incompatible" in message or "no transitions" in message.lower():
            raise ValueError(f"`{kind}`: no token sequence of this tokenizer satisfies the "
                             f"pattern ({message[:200]})") from None
        raise ValueError(f"`{kind}` cannot be compiled to a token automaton: {message[:200]} "
                         f"(supported: regular expressions without look-around or "
                         f"back-references)") from None
    try:
        automaton, states, edges = automaton_from_index(index, int(vocab_size), eos, kind)
    except ConstraintTooComplex:
        raise
    except ValueError as error:
        raise ValueError(f"`{kind}`: {error}") from None
    built = CompiledConstraint(automaton=automaton, kind=kind, regex=pattern, states=states,
                               edges=edges, build_s=time.perf_counter() - began)
    _CACHE[key] = (tokenizer, built)
    while len(_CACHE) > CACHE_SIZE:  # the least recently used goes
        _CACHE.pop(next(iter(_CACHE)))
    return built


def resolve_constraint(model, tokenizer, *, regex=None, json_schema=None, choices=None,
                       constraint=None, prefix_allowed_tokens_fn=None) -> TokenAutomaton | None:
    """The automaton a generate_ids / generate_text call asks for, or None. ValueError for
    several constraints at once or a pattern without a tokenizer, before anything compiles."""
    chosen = choose_pattern(regex, json_schema, choices)
    given = [name for name, value in (("a pattern", chosen), ("constraint=", constraint),
                                      ("prefix_allowed_tokens_fn=", prefix_allowed_tokens_fn))
             if value is not None]
    if len(given) > 1:
        names = [chosen[0] + "=" if n == "a pattern" else n for n in given]
        raise ValueError(f"pass one constraint, got {' and '.join(names)} (allowed: regex=, "
                         f"json_schema=, choices=, constraint= or prefix_allowed_tokens_fn=)")
    if chosen is None:
        return constraint
    kind, value = chosen
    return compile_constraint(tokenizer, model.vocab_size, **{kind: value}).automaton


__all__ = ["CompiledConstraint", "SCHEMA_FORMATS", "SCHEMA_KEYWORDS", "check_schema",
           "choose_pattern", "compile_constraint", "escape_literal", "pattern_regex",
           "resolve_constraint"]
