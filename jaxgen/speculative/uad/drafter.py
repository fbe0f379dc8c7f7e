"""Universal assisted decoding (UAD): an assistant with another tokenizer, the compiled pieces.

The assistant drafts in its own vocabulary. Every row's alignment between the two token
streams is host work (tokenizers: `jaxgen.drivers.uad`), done between the compiled phases
below; the device holds the assistant's KV cache and runs its forwards.

    UniversalAssistant   what a call asks for: the assistant model, its params, and the host
                         bridge between the two tokenizers (jaxgen.speculative.uad.bridge.TokenBridge)
    UadDrafter           the static drafter (K, the assistant model, greedy or sampling)
    UadParams            dynamic: the assistant's params and the vocabulary map
                         to_target int32 [Va] (assistant id -> target id, -1: none)
    HostRound            dynamic, one round's host arrays (assistant ids, cache keep point,
                         target drafts)
    UadPhase             a phase run through `jaxgen.runtime.compiled.advance` (a static loop object):
                         "prefill" (assistant prompt), "draft" (assistant drafts), "verify"
                         (target drafts from the host -> one speculative round), "round"
                         (sampling: draft, map to the target vocabulary, verify: one call)

Per round and row (L target tokens, n assistant ids, keep <= n - 1 valid assistant cache
positions, all chosen by the host):

    feed      ids[keep:n] in chunks of F positions (one `lax.while_loop`; F static)
    draft i   d_i from the scores after ids + d_<i; stop after k_want drafts, after a draft
              whose target image is an EOS id, or below the confidence threshold
    greedy    d_i = argmax(raw assistant logits); the host re-encodes the drafts' text with
              the target tokenizer (HF's AssistedCandidateGeneratorDifferentTokenizers)
    sampling  scores_i = assistant logits, tokens without a target counterpart at -inf, then
              the sampling warpers (temperature, top-k, top-p, min-p, typical, epsilon, eta);
              d_i ~ softmax(scores_i) and q_i = that distribution scattered into the target
              vocabulary (probabilities added where two assistant tokens share a target
              token): the target draft is to_target[d_i] and the standard acceptance rule
              (min(1, p/q), residual max(0, p - q)) is exact (HF's
              UniversalSpeculativeDecodingGenerator, arXiv 2502.05202)

Example (the static drafter and the draft buckets a verify uses):
    >>> from jaxgen.models import tiny_llama
    >>> model, _ = tiny_llama()
    >>> drafter = UadDrafter(model=model, num_tokens=4, sample=False)
    >>> drafter.scheduled, drafter.host_rounds, sorted(drafter.reads)
    (True, True, [])
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp

from jaxgen.cache.layout import cache_dtype
from jaxgen.config.program import eos_array
from jaxgen.core.contracts import DraftRequest, Proposal
from jaxgen.core.step import prefill_tokens, write_if_live
from jaxgen.logits.chain import sampling_warpers
from jaxgen.logits.sampling import sample_rows
from jaxgen.speculative.drafters.draft_model import split_assistant
from jaxgen.speculative.loop import speculative_rounds

FEED_WIDTH = 4  # assistant positions fed per forward before drafting (a round feeds 1..3 usually)
BUFFER_RATIO = 2  # assistant buffer = BUFFER_RATIO x the target's (its tokens may be shorter)


@dataclasses.dataclass(frozen=True, eq=False)
class UniversalAssistant:
    """An `assistant_model=` whose tokenizer differs from the target's (built by
    jaxgen.speculative.uad.bridge.universal_assistant from the two tokenizers)."""

    model: Any
    params: Any
    bridge: Any  # jaxgen.speculative.uad.bridge.TokenBridge: host-side tokenizer work and the vocabulary map


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UadParams:
    """The assistant's dynamic inputs: its params and the vocabulary map."""

    params: Any
    to_target: jax.Array  # int32 [Va]: assistant id -> target id, -1 where none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UadDraftState:
    """The drafter's state between phases."""

    cache: Any  # the assistant's KV cache [B, ..., Ta]
    drafts: jax.Array  # int32 [B, K] the last draft phase's assistant ids
    k_row: jax.Array  # int32 [B] how many of them
    forwards: jax.Array  # int32 [] assistant forwards they cost (statistics)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostRound:
    """One round's host arrays (jaxgen.drivers.uad builds them).

    ids       int32 [B, Ta]  every row's assistant ids (context), right-padded
    length    int32 [B]      n: assistant ids per row
    keep      int32 [B]      assistant cache positions still valid (<= n - 1)
    allow     bool  [B]      rows that may draft this round
    t_drafts  int32 [B, K]   greedy: the target drafts the host re-encoded
    t_count   int32 [B]      how many of them
    """

    ids: jax.Array
    length: jax.Array
    keep: jax.Array
    allow: jax.Array
    t_drafts: jax.Array
    t_count: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UadInputs:
    """The dynamic inputs of a UAD phase (AssistInputs plus the host round)."""

    draft_params: UadParams
    start_tokens: Optional[jax.Array]
    host: HostRound


def scatter_q(scores: jax.Array, to_target: jax.Array, target_vocab: int) -> jax.Array:
    """Assistant scores [..., Va] -> target-vocabulary log-probabilities [..., Vt]: each
    assistant token's probability lands on its target token (added up where several share
    one); target tokens without an assistant counterpart get -inf.

    >>> suppressed = jnp.log(jnp.array([[0.5, 0.0, 0.5]]))   # assistant token 1: no twin
    >>> jnp.exp(scatter_q(suppressed, jnp.array([2, -1, 2]), 3)).tolist()
    [[0.0, 0.0, 1.0]]
    """
    probs = jax.nn.softmax(scores, axis=-1)  # [..., Va]
    index = jnp.where(to_target >= 0, to_target, target_vocab)  # [Va] (-1 -> dropped)
    mass = jnp.zeros(scores.shape[:-1] + (target_vocab,), jnp.float32)
    mass = mass.at[..., index].add(probs, mode="drop")  # [..., Vt]
    return jnp.where(mass > 0, jnp.log(jnp.where(mass > 0, mass, 1.0)), -jnp.inf)


@dataclasses.dataclass(frozen=True)
class UadDrafter:
    """Static description of a UAD drafter (hashable; a static jit argument).

    The loop's `propose` (end of each compiled round) proposes nothing: the next drafts
    need the host (tokenizers), so `jaxgen.drivers.uad` runs the phases between rounds.
    """

    model: Any
    num_tokens: int  # K: assistant drafts per round, and target drafts verified per round
    sample: bool  # lossless sampling across vocabularies (else greedy UAD)
    prefill_chunk: int | None = None
    feed_width: int = FEED_WIDTH
    buffer_ratio: int = BUFFER_RATIO
    scheduled: ClassVar[bool] = True
    reads: ClassVar[frozenset] = frozenset()
    fallback: ClassVar[bool] = False  # the host proposes: no plain-step fallback
    host_rounds: ClassVar[bool] = True  # jaxgen.api.plan: run it with the UAD host driver

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        """The drafter for a UniversalAssistant, or None for any other request."""
        if not isinstance(assistant, UniversalAssistant):
            return None
        model, params = split_assistant((assistant.model, assistant.params))
        if cfg.assistant_ensemble_weight is not None and not cfg.do_sample:
            raise ValueError("`assistant_ensemble_weight` with greedy universal assisted "
                             "decoding (an assistant with another tokenizer) has no draft "
                             "distribution in the target's vocabulary; use do_sample=True or "
                             "drop it (allowed: assistant_ensemble_weight=None)")
        width = cfg.max_assistant_tokens or cfg.num_assistant_tokens
        drafter = cls(model=model, num_tokens=int(width), sample=bool(cfg.do_sample),
                      prefill_chunk=cfg.prefill_chunk_size)
        return drafter, UadParams(params=params, to_target=assistant.bridge.to_target_device)

    # ------------------------------------------------------------ the loop's drafter hooks
    def init(self, draft_params, state, target_params=None):
        """An empty assistant cache of BUFFER_RATIO x the target's buffer (the host fills it)."""
        dtype = cache_dtype(state.cache)
        cache = self.model.init_cache(state.batch, self.buffer_ratio * state.buffer_len, dtype)
        empty = jnp.zeros((state.batch,), jnp.int32)
        return UadDraftState(cache=cache, drafts=jnp.zeros((state.batch, self.num_tokens),
                                                           jnp.int32), k_row=empty,
                             forwards=jnp.int32(0))

    def propose(self, draft_params, draft_state, request: DraftRequest):
        """No drafts (the host proposes between rounds); the structure of a real proposal."""
        state = request.state
        batch = state.tokens.shape[0]
        q = (jnp.zeros((batch, self.num_tokens, state.model.vocab_size), jnp.float32)
             if request.keep_q else None)
        proposal = Proposal(drafts=jnp.full((batch, self.num_tokens), state.pad,
                                            jnp.int32), q_scores=q,
                            k_row=jnp.zeros((batch,), jnp.int32), tokens=state.tokens,
                            forwards=jnp.int32(0))
        return proposal, draft_state, state.cache

    def rollback(self, draft_state, length):
        """Unchanged: the host chooses the assistant cache's keep point every round."""
        return draft_state

    # ------------------------------------------------------------ the phases
    def prefill(self, draft_params: UadParams, draft_state: UadDraftState, host: HostRound,
                width: int) -> UadDraftState:
        """The assistant prompts host.ids[:, :width] (right-padded, host.length each)."""
        cache, _ = prefill_tokens(self.model, draft_params.params, host.ids[:, :width],
                                  host.length, draft_state.cache, self.prefill_chunk)
        return dataclasses.replace(draft_state, cache=cache)

    def _choose(self, cfg, logits, keys, i, to_target):
        """(draft [B], scores [B, Va]) from raw assistant logits [B, Va]."""
        logits = logits.astype(jnp.float32)
        if not self.sample:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits
        vocab = logits.shape[-1]
        mapped = jnp.zeros((vocab,), bool).at[:to_target.shape[0]].set(to_target >= 0)  # [Va]
        scores = sampling_warpers(cfg, jnp.where(mapped[None, :], logits, -jnp.inf))
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)  # [B]
        return sample_rows(scores, step_keys), scores

    def draft(self, draft_params: UadParams, draft_state: UadDraftState, host: HostRound,
              state, k_want: jax.Array, keys: jax.Array, cfg):
        """Feeds host.ids[keep:n] and drafts up to k_want[b] assistant tokens per row.

        Returns (UadDraftState with drafts / k_row, target drafts [B, K] (to_target of the
        drafts), q [B, K, Vt] log-probabilities or None, assistant forwards int32 [])."""
        model, params, K, F = self.model, draft_params.params, self.num_tokens, self.feed_width
        to_target = draft_params.to_target  # [Va]
        batch = host.ids.shape[0]
        n, keep = host.length, jnp.minimum(host.keep, host.length - 1)  # [B]
        active = host.allow & (k_want > 0)  # [B]
        last = n - 1  # [B] the position whose logits give d_0
        chunks = jnp.where(active, (n - keep + F - 1) // F, 0)  # [B]
        vocab = model.vocab_size

        def feed(carry):
            c, cache, logits = carry
            begin = keep + c * F  # [B]
            positions = begin[:, None] + jnp.arange(F, dtype=jnp.int32)[None, :]  # [B, F]
            ids = jnp.take_along_axis(host.ids, jnp.clip(positions, 0, host.ids.shape[1] - 1),
                                      axis=1)  # [B, F]
            index = jnp.clip(last - begin, 0, F - 1)[:, None]  # [B, 1]
            out = model(params, ids, positions, cache, logits_index=index)
            here = (last >= begin) & (last < begin + F) & active  # [B]
            logits = jnp.where(here[:, None], out.logits[:, 0].astype(jnp.float32), logits)
            return c + 1, out.cache, logits

        carry = (jnp.int32(0), draft_state.cache, jnp.zeros((batch, vocab), jnp.float32))
        fed, cache, logits = jax.lax.while_loop(lambda c: c[0] < jnp.max(chunks), feed, carry)

        drafts = jnp.zeros((batch, K), jnp.int32)  # [B, K]
        q = jnp.full((batch, K, state.model.vocab_size), -jnp.inf, jnp.float32) \
            if self.sample else None  # [B, K, Vt]
        eos = eos_array(cfg.eos_ids) if cfg.eos_ids else jnp.full((1,), -2, jnp.int32)  # [E]

        def step(i, logits, drafts, q, k_row, going):
            d, scores = self._choose(cfg, logits, keys, i, to_target)  # [B], [B, Va]
            d = jnp.where(going, d, 0)
            drafts = drafts.at[:, i].set(d)
            if q is not None:
                q = q.at[:, i].set(jnp.where(going[:, None], scatter_q(
                    scores, to_target, q.shape[-1]), q[:, i]))
            image = jnp.where(d < to_target.shape[0], to_target[jnp.clip(d, 0, None)], -1)
            stop = jnp.any(image[:, None] == eos[None, :], axis=1) | (i + 1 >= k_want)  # [B]
            threshold = cfg.assistant_confidence_threshold
            if threshold is not None:
                prob = jnp.take_along_axis(jax.nn.softmax(scores, -1), d[:, None], 1)[:, 0]
                stop |= prob < threshold
            return drafts, q, k_row + going.astype(jnp.int32), going & ~stop

        drafts, q, k_row, going = step(0, logits, drafts, q, jnp.zeros((batch,), jnp.int32),
                                       active)

        def cond(carry):
            i, *_, going, _ = carry
            return (i < K) & jnp.any(going)

        def body(carry):
            i, cache, drafts, q, k_row, going, count = carry
            prev = drafts[:, i - 1][:, None]  # [B, 1]
            out = model(params, prev, (n + i - 1)[:, None], cache)
            drafts, q, k_row, going = step(i, out.logits[:, 0], drafts, q, k_row, going)
            return i + 1, out.cache, drafts, q, k_row, going, count + 1

        carry = (jnp.int32(1), cache, drafts, q, k_row, going, fed)
        _, cache, drafts, q, k_row, _, forwards = jax.lax.while_loop(cond, body, carry)
        image = to_target[jnp.clip(drafts, 0, to_target.shape[0] - 1)]  # [B, K]
        t_drafts = jnp.where(jnp.arange(K)[None, :] < k_row[:, None], jnp.maximum(image, 0),
                             state.pad)  # [B, K]
        new_state = UadDraftState(cache=cache, drafts=drafts, k_row=k_row, forwards=forwards)
        return new_state, t_drafts, q, forwards


def target_proposal(state, drafts: jax.Array, count: jax.Array, q, forwards,
                    K: int) -> Proposal:
    """A proposal of target drafts [B, K] (count [B]) for the round that starts from `state`:
    capped so that n + 1 never passes a row's budget, written into the token buffer."""
    live = ~state.done  # [B]
    limit = jnp.minimum(state.prompt_len + state.max_new, state.buffer_len)  # [B]
    k_cap = jnp.clip(limit - state.length - 1, 0, K)  # [B]
    k_row = jnp.where(live, jnp.minimum(count, k_cap), 0).astype(jnp.int32)  # [B]
    tokens = state.tokens
    for i in range(K):
        tokens = write_if_live(tokens, state.length + i, drafts[:, i], i < k_row)  # [B, T]
    return Proposal(drafts=drafts.astype(jnp.int32), q_scores=q, k_row=k_row, tokens=tokens,
                    forwards=jnp.asarray(forwards, jnp.int32))


def draft_keys(state) -> jax.Array:
    """The round's draft keys: fold_in(fold_in(row_key, L), 0), as the assisted loop's."""
    round_keys = jax.vmap(jax.random.fold_in)(state.key, state.length)  # [B]
    return jax.vmap(lambda k: jax.random.fold_in(k, 0))(round_keys)


def draft_want(state, carry, K: int, allow: jax.Array) -> jax.Array:
    """int32 [B]: assistant drafts per row: the schedule's length, capped by the budget."""
    limit = jnp.minimum(state.prompt_len + state.max_new, state.buffer_len)  # [B]
    k_cap = jnp.clip(limit - state.length - 1, 0, K)  # [B]
    return jnp.where(~state.done & allow, jnp.minimum(carry.k_sched, k_cap), 0)


@dataclasses.dataclass(frozen=True)
class UadPhase:
    """One UAD phase as a loop object for `jaxgen.runtime.compiled.advance` (static; one compiled
    program per phase, and per prompt bucket for "prefill"). extra = (SpecCarry, StepRecord)
    of the speculative loop; inputs = UadInputs; `begin` is the round index ("verify" and
    "round" run round begin only)."""

    drafter: UadDrafter
    ext: Any
    phase: str  # "prefill" | "draft" | "verify" | "round"
    width: int = 0  # "prefill": the assistant prompt bucket

    def advance(self, params, state, extra, begin, end, cfg, inputs: UadInputs):
        carry, record = extra
        drafter, host = self.drafter, inputs.host
        K = drafter.num_tokens
        dstate = carry.draft_state
        if self.phase == "prefill":
            dstate = drafter.prefill(inputs.draft_params, dstate, host, self.width)
            return state, (dataclasses.replace(carry, draft_state=dstate), record)
        if self.phase in ("draft", "round"):
            k_want = draft_want(state, carry, K, host.allow)
            dstate, t_drafts, q, forwards = drafter.draft(inputs.draft_params, dstate, host,
                                                          state, k_want, draft_keys(state), cfg)
            carry = dataclasses.replace(carry, draft_state=dstate)
            if self.phase == "draft":
                return state, (carry, record)
            proposal = target_proposal(state, t_drafts, dstate.k_row, q, forwards, K)
        else:  # "verify": the host's target drafts
            q = carry.pending.q_scores
            proposal = target_proposal(state, host.t_drafts, host.t_count, q, dstate.forwards, K)
        carry = dataclasses.replace(carry, pending=proposal)
        _, state, carry, record = speculative_rounds(params, inputs, state, carry, record, cfg,
                                                     drafter, self.ext, start=begin,
                                                     stop=begin + 1)
        return state, (carry, record)


__all__ = ["BUFFER_RATIO", "FEED_WIDTH", "HostRound", "UadDraftState", "UadDrafter",
           "UadInputs", "UadParams", "UadPhase", "UniversalAssistant", "draft_keys",
           "scatter_q", "target_proposal"]
