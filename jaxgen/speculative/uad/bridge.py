"""Two tokenizers side by side for universal assisted decoding (host work, no device).

    TextCodec            one tokenizer behind one interface: jaxgen.models' Tokenizer, a raw
                         `tokenizers.Tokenizer`, or a transformers fast tokenizer; batched
                         encode / decode (the Rust backend's batch calls when there is one)
    TokenBridge          the pair: text conversions both ways and the assistant -> target map
                         by exact token string (HF's AssistantToTargetTranslator), with the
                         byte-level / SentencePiece space marks (`Ġ` vs `▁`) normalised
    universal_assistant  what jaxgen.api.plan calls: checks the arguments and returns the
                         assistant unchanged (same vocabulary) or a UniversalAssistant

Example (two byte-level BPEs that differ in one merge):
    >>> from jaxgen.models import tiny_tokenizer
    >>> target, assistant = tiny_tokenizer(), tiny_tokenizer()
    >>> assistant.backend.add_tokens(["zz"])
    1
    >>> bridge = TokenBridge(target, assistant, 261, 262)
    >>> int(bridge.to_target[261]), int(bridge.to_target[83])      # "zz" has no counterpart
    (-1, 83)
    >>> bridge.to_assistant([[83, 71, 68]], add_special_tokens=False)  # "t" "h" "e" -> "the"
    [[260]]
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from jaxgen.speculative.drafters.draft_model import split_assistant
from jaxgen.speculative.drafters.mtp_assistant import target_reading_model
from jaxgen.speculative.uad.drafter import UniversalAssistant

UAD_ARGS = ("pass the target's `tokenizer=` and the assistant's `assistant_tokenizer=` "
            "(universal assisted decoding)")


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a tokenizer, or None."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    for name in ("backend", "backend_tokenizer", "_tokenizer"):
        found = getattr(tokenizer, name, None)
        if isinstance(found, tokenizers.Tokenizer):
            return found
    return None


class TextCodec:
    """Batched encode / decode and the vocabulary of one tokenizer."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        self.backend = _backend(tokenizer)
        if self.backend is None and not all(hasattr(tokenizer, m) for m in
                                            ("encode", "decode", "get_vocab")):
            raise ValueError(f"`{name}` must be a tokenizer (jaxgen.models' Tokenizer, a "
                             f"tokenizers.Tokenizer or a transformers tokenizer), got "
                             f"{type(tokenizer).__name__}")

    def vocab(self) -> dict[str, int]:
        if self.backend is not None:
            return self.backend.get_vocab(with_added_tokens=True)
        return dict(self.tokenizer.get_vocab())

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        """Text of each row, special tokens skipped."""
        rows = [[int(i) for i in row] for row in rows]
        if self.backend is not None:
            return self.backend.decode_batch(rows, skip_special_tokens=True)
        return [self.tokenizer.decode(row, skip_special_tokens=True) for row in rows]

    def encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        try:
            if self.backend is not None:
                return [e.ids for e in self.backend.encode_batch(
                    list(texts), add_special_tokens=add_special_tokens)]
            return [list(self.tokenizer.encode(t, add_special_tokens=add_special_tokens))
                    for t in texts]
        except Exception as error:
            raise ValueError(f"`{self.name}` cannot encode the other tokenizer's text "
                             f"({error}); universal assisted decoding needs tokenizers that "
                             f"encode any text (e.g. byte-level BPE)") from None

    def space_sign(self) -> str | None:
        """The first character of the token that encodes " " (HF: `Ġ`, `▁`), or None."""
        [ids] = self.encode([" "], add_special_tokens=False)
        if not ids:
            return None
        if self.backend is not None:
            token = self.backend.id_to_token(ids[0])
        else:
            token = self.tokenizer.convert_ids_to_tokens(ids[0])
        return token[0] if token else None

    def size(self) -> int:
        return max(self.vocab().values(), default=-1) + 1


class TokenBridge:
    """Host-side conversions between a target and an assistant tokenizer.

    to_target          int64 [Va] assistant id -> target id by exact token string (-1: none)
    target_to_assistant  {target id: assistant id} for the same pairs (HF's dict)
    to_target_device   to_target as an int32 device array (the compiled pieces' map)
    """

    def __init__(self, tokenizer, assistant_tokenizer, target_vocab: int, assistant_vocab: int):
        self.target = TextCodec(tokenizer, "tokenizer")
        self.assistant = TextCodec(assistant_tokenizer, "assistant_tokenizer")
        for codec, size, who in ((self.target, target_vocab, "target model"),
                                 (self.assistant, assistant_vocab, "assistant model")):
            if codec.size() > size:
                raise ValueError(f"`{codec.name}` has ids up to {codec.size() - 1} but the "
                                 f"{who}'s vocabulary has {size} tokens: pass the "
                                 f"{who}'s own tokenizer")
        target_strings = self.target.vocab()
        assistant_strings = self.assistant.vocab()
        self.same_vocabulary = target_strings == assistant_strings
        t_sign, a_sign = self.target.space_sign(), self.assistant.space_sign()
        if t_sign and a_sign and t_sign != a_sign:  # e.g. "▁the" -> "Ġthe"
            assistant_strings = {(s.replace(a_sign, t_sign, 1) if s.startswith(a_sign) else s): i
                                 for s, i in assistant_strings.items()}
        to_target = np.full((assistant_vocab,), -1, np.int64)
        self.target_to_assistant: dict[int, int] = {}
        for string, a_id in assistant_strings.items():
            t_id = target_strings.get(string)
            if t_id is not None and a_id < assistant_vocab and t_id < target_vocab:
                to_target[a_id] = t_id
                self.target_to_assistant[t_id] = a_id
        self.to_target = to_target
        self._device = None

    @property
    def shared(self) -> int:
        """How many assistant tokens have a target counterpart."""
        return int(np.sum(self.to_target >= 0))

    @property
    def to_target_device(self):
        if self._device is None:
            import jax.numpy as jnp

            self._device = jnp.asarray(self.to_target, jnp.int32)
        return self._device

    def to_assistant(self, rows, add_special_tokens: bool = True) -> list[list[int]]:
        """Target id rows -> their text -> assistant ids (HF: special tokens skipped)."""
        return self.assistant.encode(self.target.decode(rows), add_special_tokens)

    def to_target_ids(self, rows, add_special_tokens: bool = True) -> list[list[int]]:
        """Assistant id rows -> their text -> target ids."""
        return self.target.encode(self.assistant.decode(rows), add_special_tokens)


_BRIDGES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def token_bridge(tokenizer, assistant_tokenizer, target_vocab: int,
                 assistant_vocab: int) -> TokenBridge:
    """A TokenBridge, cached per tokenizer pair (the map is built once, as HF caches it)."""
    key = (id(assistant_tokenizer), target_vocab, assistant_vocab)
    try:
        per_target = _BRIDGES.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: no cache
        return TokenBridge(tokenizer, assistant_tokenizer, target_vocab, assistant_vocab)
    found = per_target.get(key)
    if found is None or found[0]() is not assistant_tokenizer:
        bridge = TokenBridge(tokenizer, assistant_tokenizer, target_vocab, assistant_vocab)
        try:
            ref = weakref.ref(assistant_tokenizer)
        except TypeError:
            return bridge
        per_target[key] = found = (ref, bridge)
    return found[1]


def universal_assistant(assistant_model, tokenizer, assistant_tokenizer, target_model):
    """The `assistant_model=` a call drafts with: unchanged without `assistant_tokenizer`
    (or when both tokenizers hold the same vocabulary, or for an MTP drafter, which drafts in
    the target's own tokens), else a UniversalAssistant.
    Raises ValueError, naming the argument, for combinations that cannot run."""
    if assistant_tokenizer is None or target_reading_model(assistant_model) is not None:
        return assistant_model
    if assistant_model is None:
        raise ValueError("`assistant_tokenizer=` needs `assistant_model=(model, params)`, the "
                         "assistant it tokenizes for")
    if tokenizer is None:
        raise ValueError("`assistant_tokenizer=` needs the target's tokenizer too: "
                         f"{UAD_ARGS} (generate_text passes its own)")
    model, params = split_assistant(assistant_model)
    bridge = token_bridge(tokenizer, assistant_tokenizer, int(target_model.vocab_size),
                          int(model.vocab_size))
    if bridge.same_vocabulary and int(model.vocab_size) == int(target_model.vocab_size):
        return assistant_model  # one vocabulary: plain assisted decoding
    if bridge.shared == 0:
        raise ValueError("`tokenizer` and `assistant_tokenizer` share no token string, so "
                         "no assistant draft can be verified; use an assistant whose "
                         "tokenizer shares tokens with the target's")
    return UniversalAssistant(model=model, params=params, bridge=bridge)


__all__ = ["TextCodec", "TokenBridge", "UAD_ARGS", "token_bridge", "universal_assistant"]
