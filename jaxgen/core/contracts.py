"""The contracts the decoding core relies on: `Model`, `Cache` and `Drafter`.

The core never imports a model family. Everything it knows about a model, a KV cache or a
drafter is written here as a `typing.Protocol`; a new model family, cache kind or drafter
kind honours one of them and nothing else changes.

    Model     a static, hashable description (frozen dataclass) + pure functions over a
              params PyTree passed in (never closed over).
    Cache     fixed-shape PyTree of every layer's keys / values with a per-row length
              (jaxgen.cache.protocol; re-exported here).
    Drafter   a static, hashable description of one way to propose draft tokens for
              assisted decoding; the assisted loop (jaxgen.speculative.loop) verifies them.

Example:
    >>> from jaxgen.speculative.drafters.prompt_lookup import PromptLookupDrafter
    >>> isinstance(PromptLookupDrafter(num_tokens=4, max_ngram=2), Drafter)
    True
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Protocol, runtime_checkable

import jax

from jaxgen.cache import Cache
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.extensions import Extensions


# ------------------------------------------------------------------------- model
@runtime_checkable
class ModelOutput(Protocol):
    """What a forward returns."""

    logits: jax.Array  # float32 [B, S', V]: S' = S, or the positions `logits_index` picks
    hidden: jax.Array  # [B, S, D]: the last layer's hidden states, before the final norm
    cache: Cache  # the cache with the new keys / values written at `positions`


@runtime_checkable
class Model(Protocol):
    """A decoder the core can run.

    `config` may carry `eos_token_id`, `pad_token_id`, `bos_token_id` (ints or None) and
    `generation_defaults` (pairs of GenerationConfig fields, the checkpoint's
    generation_config.json): `jaxgen.api.generate.default_config` reads them.

    Optional: `check_params(params)` raises ValueError naming the first parameter whose
    shape does not match the model; `generate` calls it before compiling.
    """

    config: Any

    @property
    def vocab_size(self) -> int: ...

    def init_cache(self, batch: int, max_len: int, dtype: Any = ..., kind: str = "static",
                   cache_config: Optional[dict] = None) -> Cache:
        """An empty cache of HF's `cache_implementation` kind for `max_len` positions."""

    def __call__(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                 logits_index: Optional[jax.Array] = None) -> ModelOutput:
        """tokens, positions int32 [B, S] -> logits, hidden, cache (written at positions).

        Ragged rows: a key at index j is visible to a query at position p iff j <= p (and
        inside the model's sliding window); keys at j >= the row's cache length are stale
        and get overwritten before they become visible. logits_index int32 [B, S'] picks
        the positions that get logits (the prefill asks for each row's last one).
        """


@runtime_checkable
class LayeredModel(Model, Protocol):
    """A model whose layers run in ranges: what self-speculation (early exit) needs.

    config.num_layers                                          L
    embed(params, tokens[B,S]) -> x[B,S,D]                     input embeddings
    run_layers(params, x, positions, cache, start, stop) -> (x, cache)
        layers [start, stop) (static), writing their K/V at positions; length unchanged
    head(params, hidden[B,S,D]) -> logits[B,S,V] float32       final norm + LM head
    exit_head(params, hidden, layer) -> logits                 layer's exit adapter (if the
                                                               params carry one) + head
    """

    def embed(self, params: Any, tokens: jax.Array) -> jax.Array: ...

    def run_layers(self, params: Any, x: jax.Array, positions: jax.Array, cache: Cache,
                   start: int, stop: int) -> tuple[jax.Array, Cache]: ...

    def head(self, params: Any, hidden: jax.Array) -> jax.Array: ...

    def exit_head(self, params: Any, hidden: jax.Array, layer: int) -> jax.Array: ...


# ------------------------------------------------------------------------- drafter
# A drafter's own state between rounds: any PyTree it chooses (the draft model's KV cache,
# the last MTP hidden state, ...) or None for drafters that keep nothing (prompt lookup).
DraftState = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """One round of drafts from a drafter.

    drafts    int32 [B, K]        proposed tokens (entries at i >= k_row are ignored)
    q_scores  float32 [B, K, V]   processed scores the drafts were drawn from, or None for a
                                  deterministic drafter (one-hot q: prompt lookup)
    k_row     int32 [B]           drafts per row (0 = none: the round emits one target token)
    tokens    int32 [B, T]        the row tokens with the drafts written at L .. L+K-1 (what
                                  the processors at each verify position read)
    forwards  int32 []            draft forwards this round cost (statistics)
    """

    drafts: jax.Array
    q_scores: Optional[jax.Array]
    k_row: jax.Array
    tokens: jax.Array
    forwards: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """Everything a drafter may read when it proposes a round (built inside the trace).

    state          the target's DecodeState: tokens [B, T], length [B], the target's KV
                   cache (`state.cache`), per-row keys, budgets
    k_want         int32 [B]: most drafts each row may take this round (0 for done rows)
    keys           PRNG keys [B]: this round's draft keys (fold_in(row key, L), tag 0)
    cfg, ext       the (canonical) config and the user hooks: drafts are processed like the
                   target's scores, so q is exactly the distribution they were drawn from
    do_sample      draw (True) or argmax (False)
    keep_q         whether the proposal must carry q_scores (sampling or an ensemble)
    threshold      HF's assistant_confidence_threshold (None: off)
    target_params  the target's params when the drafter reads "params", else None
    hidden         float [B, D]: the target's last hidden state at each row's newest
                   verified position, when the drafter reads "hidden", else None
    hidden_states  float [B, W, D]: the target's last hidden states (before the final norm)
                   of the positions the last forward verified, when the drafter reads
                   "hidden_states" (e.g. MTP layers), else None. Entry j is position
                   hidden_start + j; entries j < state.length - 1 - hidden_start are the
                   verified ones (the round's emitted tokens; after the prefill, the prompt)
    hidden_start   int32 [B]: the position of hidden_states[:, 0] (0 after the prefill)
    """

    state: Any
    k_want: jax.Array
    keys: jax.Array
    cfg: GenerationConfig
    ext: Extensions
    do_sample: bool
    keep_q: bool
    threshold: Any = None
    target_params: Any = None
    hidden: Optional[jax.Array] = None
    hidden_states: Optional[jax.Array] = None
    hidden_start: Optional[jax.Array] = None


@runtime_checkable
class Drafter(Protocol):
    """One drafter kind. Instances are static (hashable, part of the compiled program).

    num_tokens   K: the static draft width (a round verifies at most K drafts per row)
    scheduled    whether `num_assistant_tokens_schedule`'s start value and the confidence
                 threshold apply (draft models: yes; prompt lookup: always starts at K)
    reads        what the drafter reads from the target besides its tokens:
                 "params" (it runs part of the target, e.g. early exit), "hidden" (the
                 target's last hidden state, e.g. MTP heads), "hidden_states" (the hidden
                 states of every position the last forward verified, e.g. the checkpoint's
                 MTP layers), "cache" (it writes or reads the target's KV cache, e.g. a
                 shared-cache early exit); the loop hands these over in the DraftRequest
                 only when asked

    Methods (all traced inside the one compiled loop):
        init(draft_params, state, target_params=None) -> draft_state   after the prefill
            (target_params: the target's params for drafters that read "params")
        propose(draft_params, draft_state, request) -> (Proposal, draft_state, cache)
            cache: the target's cache, returned unchanged unless the drafter writes it
        rollback(draft_state, length) -> draft_state       after a round left rows at length
    Optional:
        verify(params, draft_state, state, tokens, positions) -> (logits, hidden, cache)
            the round's verify forward over tokens [B, k+1] at positions [B, k+1], for a
            drafter that already computed part of it (shared compute, e.g. early exit runs
            only the layers after its exit); without it the target's full forward runs
        fallback (class attribute, default True): False when the drafter's proposals come
            from outside the loop (UAD's host), so the plain-step fallback stays off

    Building one is the plan's job (jaxgen.api.plan): each kind has a classmethod
    `from_request(cfg, target_model, assistant) -> (drafter, draft_params) | None` that
    returns None when the call does not ask for that kind.
    """

    num_tokens: int
    scheduled: ClassVar[bool]
    reads: ClassVar[frozenset]

    def init(self, draft_params: Any, state: Any, target_params: Any = None) -> DraftState: ...

    def propose(self, draft_params: Any, draft_state: DraftState,
                request: DraftRequest) -> tuple[Proposal, DraftState, Cache]: ...

    def rollback(self, draft_state: DraftState, length: jax.Array) -> DraftState: ...


__all__ = ["Cache", "DraftState", "Drafter", "DraftRequest", "LayeredModel", "Model",
           "ModelOutput", "Proposal"]
