"""The speculative loop: prefill, then one `lax.while_loop` of draft -> verify -> accept rounds.

Per round, for every row b with length L (its tokens are tokens[b, :L]; the target cache
holds positions < L - 1, the last token is fed by the next forward):

    k_want   = min(k_sched[b], remaining_budget - 1, K)      (so n + 1 never passes the budget)
    drafts   = drafter.propose(...)                          [B, K] (+ q scores, k_row <= k_want)
    verify   = target(tokens[L-1], d_0..d_{K-1} at positions L-1 .. L+K-1)   one forward
    p        = processors at every position j with the prefix ending at L + j   [B, K+1, V]
    n, fix   = verify.accept_greedy / accept_sample                           per row
    out_j    = d_j (j < n), fix (j = n)
    m        = emitted tokens: n + 1, cut after the first position j <= n where EOS, a stop
               string, a custom criterion or the budget fires (so no token follows a stop)
    L'       = L + m;  target cache length := L' - 1;  draft cache length := L' - 2

Rows that are done keep their tokens and lengths (their lanes still compute: static shapes);
every live row advances by its own m >= 1, so nothing waits for the slowest row.

Verify width. A round's drafts are proposed at the end of the round before it (they only
depend on the state it leaves), so the next round knows the longest live draft k_max before
it runs. Each draft bucket k in `draft_buckets(K)` = {0, 1, 3, 7, ..., K} has its own inner
`lax.while_loop` whose verify forward is k + 1 wide; the outer loop visits the buckets in turn
and a round runs in the smallest bucket >= k_max. When prompt lookup finds nothing the round
is a one-position forward; when the schedule shrinks every row's draft the forward shrinks
with it. Nested while loops keep the KV cache in place, where a `lax.cond` / `lax.switch`
over forwards of different widths makes XLA copy the whole cache every round (35 ms for
SmolLM2 at batch 8 here). The width never cuts a row's drafts, so a row's output does not
depend on the other rows of the batch.

Sampling keys: the round key of row b is fold_in(row_key[b], L) (a row's L is different every
round), split by tag into draft draws (0), acceptance uniforms (1) and the fix draw (2): a row's
output never depends on which other rows share the batch.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen import stopping
from jaxgen.config import GenerationConfig
from jaxgen.decode import StepRecord, decode_start
from jaxgen.extensions import NO_EXTENSIONS, Extensions
from jaxgen.processors import ProcessorContext
from jaxgen.speculative import verify
from jaxgen.speculative.positions import process_positions
from jaxgen.state import DecodeState
from jaxgen.stopping_strings import stop_string_hit

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeStats:
    """Acceptance statistics of one speculative call (`GenerateOutput.speculative`).

    rounds             int32 [B]     verify rounds the row took part in while live
    drafted            int32 [B]     drafts proposed to the row (sum of k_row)
    accepted           int32 [B]     drafts accepted (sum of n)
    position_tried     int32 [B, K]  rounds in which draft position i was proposed
    position_accepted  int32 [B, K]  rounds in which draft position i was accepted
    target_forwards    int32 []      target forwards: prefill + verify rounds
    verified_positions int32 []      positions the verify forwards computed per row (each round
                                     k + 1 for its width bucket k): the compute spent
    draft_forwards     int32 []      draft-model forwards (prefill included; 0 for prompt lookup)
    num_assistant_tokens int32 [B]   the draft length the next call should start from
                                     (changed only by the "heuristic" schedule, as in HF)
    """

    rounds: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    position_tried: jax.Array
    position_accepted: jax.Array
    target_forwards: jax.Array
    verified_positions: jax.Array
    draft_forwards: jax.Array
    num_assistant_tokens: jax.Array

    @classmethod
    def zeros(cls, batch: int, K: int, start: jax.Array) -> "SpeculativeStats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(rounds=z, drafted=z, accepted=z,
                   position_tried=jnp.zeros((batch, K), jnp.int32),
                   position_accepted=jnp.zeros((batch, K), jnp.int32),
                   target_forwards=jnp.int32(1), verified_positions=jnp.int32(0),
                   draft_forwards=jnp.int32(0),
                   num_assistant_tokens=start)

    @property
    def mean_accepted(self) -> jax.Array:
        """float32 [B]: accepted drafts per verify round."""
        return self.accepted / jnp.maximum(self.rounds, 1)

    @property
    def tokens_per_round(self) -> jax.Array:
        """float32 [B]: tokens emitted per verify round (accepted + the fix / bonus token)."""
        return (self.accepted + self.rounds) / jnp.maximum(self.rounds, 1)

    @property
    def acceptance_rate(self) -> jax.Array:
        """float32 [B]: accepted / drafted."""
        return self.accepted / jnp.maximum(self.drafted, 1)

    @property
    def position_acceptance(self) -> jax.Array:
        """float32 [K]: over all rows, P(draft i accepted | draft i proposed)."""
        return (jnp.sum(self.position_accepted, 0)
                / jnp.maximum(jnp.sum(self.position_tried, 0), 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecCarry:
    """Per-mode state of the assisted loop (kept in `DecodeState.spec` of the final state)."""

    draft_state: Any  # the drafter's state: the draft KV cache, or None (prompt lookup)
    k_sched: jax.Array  # int32 [B] the schedule's current draft length per row
    stats: SpeculativeStats
    pending: Any  # Proposal: the drafts the next round verifies (k_row already capped)


def draft_buckets(K: int) -> tuple[int, ...]:
    """The static draft counts a verify forward is compiled for: 0, 2^i - 1 < K, and K.

    >>> draft_buckets(10)
    (0, 1, 3, 7, 10)
    """
    sizes, size = [0], 1
    while size < K:
        sizes.append(size)
        size = 2 * size + 1
    return tuple(sizes + [K]) if K > 0 else (0,)


def _bucket_index(k_row: jax.Array, K: int) -> jax.Array:
    """int32 []: the smallest bucket that holds every row's drafts (k_row int32 [B])."""
    sizes = jnp.asarray(draft_buckets(K), jnp.int32)  # [nb]
    return jnp.sum(sizes < jnp.max(k_row)).astype(jnp.int32)


def _verify_forward(params, state: DecodeState, work: jax.Array, drafts: jax.Array, cfg,
                    ext: Extensions):
    """Target forward over [last token, drafts] (drafts [B, k], k static) and the processed
    scores at every position. Returns (p_scores [B, k+1, V], raw [B, k+1, V], cache)."""
    model = state.model
    last = state.length - 1  # [B]
    last_token = jnp.take_along_axis(state.tokens, last[:, None], axis=1)  # [B, 1]
    tokens = jnp.concatenate([last_token, drafts], axis=1)  # [B, k+1]
    positions = last[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [B, k+1]
    out = model(params, tokens, positions, state.cache)
    raw = out.logits.astype(jnp.float32)  # [B, k+1, V]
    scores = process_positions(cfg, raw, work, state.length, state, ext.logits_processor)
    return scores, raw, out.cache


def _stop_flags(cfg, state: DecodeState, tokens: jax.Array, out: jax.Array,
                scores: jax.Array, ext: Extensions):
    """Per emitted position j (token out[:, j] at index L + j): bool [B, K+1] each for EOS,
    stop string, custom criterion and budget, evaluated with the tokens up to and including j."""
    batch, width = out.shape
    new_length = state.length[:, None] + 1 + jnp.arange(width)[None, :]  # [B, K+1]
    eos = stopping.hit_eos(out, cfg.eos_ids)  # [B, K+1]
    full = stopping.out_of_budget(new_length, state.prompt_len[:, None], state.max_new[:, None],
                                  state.buffer_len)  # [B, K+1]
    none = jnp.zeros_like(eos)
    string = custom = none
    if state.stop_tables is not None:
        string = jax.vmap(lambda n: stop_string_hit(state.stop_tables, tokens, n),
                          in_axes=1, out_axes=1)(new_length)
    if ext.stopping_criteria:
        def one(n, s):
            ctx = ProcessorContext(tokens=tokens, length=n, prompt_len=state.prompt_len,
                                   max_new=state.max_new)
            return stopping.custom_stop(ext.stopping_criteria, ctx, s)
        custom = jax.vmap(one, in_axes=(1, 1), out_axes=1)(new_length, scores)
    return eos, string, custom, full


def _write_record(record: StepRecord, state: DecodeState, emit: jax.Array, out: jax.Array,
                  scores: jax.Array, raw: jax.Array) -> StepRecord:
    """Writes per-token records of the emitted positions (emit bool [B, K+1])."""
    steps = record.token_logprobs.shape[1]
    batch, width = out.shape
    step = state.length[:, None] - state.prompt_len[:, None] + jnp.arange(width)[None, :]
    step = jnp.where(emit, step, steps)  # [B, K+1]; out of range -> dropped
    rows = jnp.arange(batch)[:, None]
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(scores, axis=-1), out[..., None],
                                   axis=-1)[..., 0]  # [B, K+1]
    put = lambda buf, v: None if buf is None else buf.at[rows, step].set(v, mode="drop")  # noqa
    return dataclasses.replace(record, token_logprobs=put(record.token_logprobs, logprobs),
                               scores=put(record.scores, scores), logits=put(record.logits, raw))


def _round_keys(state: DecodeState):
    """Per-row round keys fold_in(row_key, L), split by tag: draft draws (0), acceptance
    uniforms (1), the fix draw (2). Returns tag -> keys [B]."""
    round_keys = jax.vmap(jax.random.fold_in)(state.key, state.length)  # [B]
    return lambda t: jax.vmap(lambda k: jax.random.fold_in(k, t))(round_keys)


def propose_next(draft_params, state: DecodeState, carry: SpecCarry, cfg: GenerationConfig,
                 drafter, ext: Extensions = NO_EXTENSIONS) -> SpecCarry:
    """Drafts for the round that starts from `state`; stored as `carry.pending`."""
    K = drafter.num_tokens
    width = state.tokens.shape[1]
    live = ~state.done  # [B]
    limit = jnp.minimum(state.prompt_len + state.max_new, width)  # [B] row's max length
    k_cap = jnp.clip(limit - state.length - 1, 0, K)  # [B] so n + 1 never passes the budget
    k_want = jnp.where(live, jnp.minimum(carry.k_sched, k_cap), 0)  # [B]
    weight = cfg.assistant_ensemble_weight
    threshold = cfg.assistant_confidence_threshold  # None or <= 0: off (HF)
    proposal, draft_state = drafter.propose(
        draft_params, carry.draft_state, cfg, ext, state, k_want, _round_keys(state)(0),
        do_sample=cfg.do_sample, keep_q=cfg.do_sample or weight is not None, threshold=threshold)
    k_row = jnp.where(live, jnp.minimum(proposal.k_row, k_want), 0)  # [B]
    proposal = dataclasses.replace(proposal, k_row=k_row)
    return dataclasses.replace(carry, draft_state=draft_state, pending=proposal)


def speculative_round(params, draft_params, state: DecodeState, carry: SpecCarry,
                      record: StepRecord, cfg: GenerationConfig, drafter,
                      ext: Extensions = NO_EXTENSIONS, width: int | None = None):
    """Verifies `carry.pending` (every row's k_row <= width, static; default K), accepts,
    emits, rolls back, then proposes the next round's drafts. Returns (state, carry, record)."""
    K = drafter.num_tokens
    k = K if width is None else int(width)
    batch, buffer = state.tokens.shape
    live = ~state.done  # [B]
    length = state.length  # [B]
    tag = _round_keys(state)
    weight = cfg.assistant_ensemble_weight
    proposal = carry.pending
    k_row = proposal.k_row  # [B] <= k
    drafts = proposal.drafts[:, :k]  # [B, k]
    q_scores = None if proposal.q_scores is None else proposal.q_scores[:, :k]  # [B, k, V]

    p_scores, raw, cache = _verify_forward(params, state, proposal.tokens, drafts, cfg, ext)
    if cfg.do_sample:
        uniforms = jax.vmap(lambda key: jax.random.uniform(key, (K,)))(tag(1))[:, :k]  # [B, k]
        n, fix = verify.accept_sample(drafts, k_row, p_scores, q_scores, uniforms, tag(2),
                                      weight)
    else:
        n, fix = verify.accept_greedy(drafts, k_row, p_scores, q_scores, weight)
    out = verify.assemble(drafts, n, fix, state.pad_token_id)  # [B, k+1]

    # Emit out[:, :n+1] but stop after the first position where a stop condition fires.
    rows = jnp.arange(batch)[:, None]
    index = length[:, None] + jnp.arange(k + 1)[None, :]  # [B, k+1]
    candidate = jnp.arange(k + 1)[None, :] <= n[:, None]  # [B, k+1]
    written = state.tokens.at[rows, jnp.where(candidate & live[:, None], index, buffer)].set(
        out, mode="drop")  # [B, T]
    eos, string, custom, full = _stop_flags(cfg, state, written, out, p_scores, ext)
    fires = (eos | string | custom | full) & candidate  # [B, k+1]
    first = jnp.where(jnp.any(fires, 1), jnp.argmax(fires, 1), k + 1)  # [B]
    emitted = jnp.where(live, jnp.minimum(n, first) + 1, 0).astype(jnp.int32)  # [B] m
    emit = jnp.arange(k + 1)[None, :] < emitted[:, None]  # [B, k+1]
    tokens = state.tokens.at[rows, jnp.where(emit, index, buffer)].set(out, mode="drop")
    new_length = length + emitted  # [B]
    at_last = lambda a: jnp.take_along_axis(a, jnp.maximum(emitted - 1, 0)[:, None],  # noqa
                                            axis=1)[:, 0] & live
    done, reason = stopping.update_stop(state.done, state.stop_reason, at_last(eos),
                                        at_last(full), at_last(string) if state.stop_tables
                                        is not None else None,
                                        at_last(custom) if ext.stopping_criteria else None)
    record = _write_record(record, state, emit, out, p_scores, raw)

    # Roll both caches back by length.
    cache = cache.rollback(jnp.where(live, cache.length - (new_length - 1), 0))
    draft_state = drafter.rollback(carry.draft_state, new_length)

    # Statistics and the draft-length schedule (HF: +2 when every draft passed, else -1).
    position = jnp.arange(K)[None, :]
    live_i = live.astype(jnp.int32)
    accepted = jnp.where(live, n, 0)  # [B]
    stats = carry.stats
    stats = dataclasses.replace(
        stats, rounds=stats.rounds + live_i, drafted=stats.drafted + k_row,
        accepted=stats.accepted + accepted,
        position_tried=stats.position_tried + (position < k_row[:, None]).astype(jnp.int32),
        position_accepted=stats.position_accepted + (position < accepted[:, None]
                                                     ).astype(jnp.int32),
        target_forwards=stats.target_forwards + 1,
        verified_positions=stats.verified_positions + (k + 1),
        draft_forwards=stats.draft_forwards + proposal.forwards)
    k_sched = carry.k_sched
    schedule = cfg.num_assistant_tokens_schedule
    if schedule in ("heuristic", "heuristic_transient"):
        grown = jnp.where(emitted - 1 >= k_row, k_sched + 2, jnp.maximum(k_sched - 1, 1))
        # A round in which the budget left no room for a draft says nothing about the draft
        # (nor does a prompt-lookup round that found no match).
        k_sched = jnp.where(live & (k_row > 0), jnp.clip(grown, 1, K), k_sched)
    if schedule == "heuristic" and drafter.scheduled:
        stats = dataclasses.replace(stats, num_assistant_tokens=k_sched)
    state = state.replace(tokens=tokens, length=new_length, done=done, stop_reason=reason,
                          cache=cache)
    carry = dataclasses.replace(carry, draft_state=draft_state, k_sched=k_sched, stats=stats)
    return state, propose_next(draft_params, state, carry, cfg, drafter, ext), record


def speculative_start(params, state: DecodeState, cfg: GenerationConfig, drafter,
                      draft_params=None, start_tokens=None, ext: Extensions = NO_EXTENSIONS):
    """Prefill, the first token and the drafter's initial state.

    Returns (state, SpecCarry, StepRecord): the carry that `speculative_rounds` advances.
    """
    K = drafter.num_tokens
    batch = state.batch
    state, record = decode_start(params, state, cfg, ext)
    draft_state = drafter.init(draft_params, state)
    if not drafter.scheduled:  # prompt lookup: always up to K drafts
        start = jnp.full((batch,), K, jnp.int32)
    elif start_tokens is None:
        start = jnp.full((batch,), min(int(cfg.num_assistant_tokens), K), jnp.int32)
    else:
        start = jnp.broadcast_to(jnp.clip(jnp.asarray(start_tokens, jnp.int32), 1, K), (batch,))
    stats = SpeculativeStats.zeros(batch, K, start)
    if draft_state is not None:
        stats = dataclasses.replace(stats, draft_forwards=jnp.int32(1))
    carry = SpecCarry(draft_state=draft_state, k_sched=start, stats=stats, pending=None)
    return state, propose_next(draft_params, state, carry, cfg, drafter, ext), record


def speculative_rounds(params, state: DecodeState, carry, record, cfg: GenerationConfig,
                       drafter, draft_params=None, ext: Extensions = NO_EXTENSIONS, *,
                       start=1, stop=None):
    """Runs rounds start..stop-1 (fewer once every row is done). Returns (next round index,
    state, SpecCarry, StepRecord). The chunked driver calls it a few rounds per jit call;
    `speculative_loop` once for the whole budget.

    An outer `lax.while_loop` visits one inner while loop per draft bucket (module docs); a
    round runs in the inner loop whose width is the smallest that holds its drafts.
    """
    steps = state.buffer_len - state.prompt_bucket
    stop = steps if stop is None else jnp.minimum(stop, steps)

    def running(loop):
        i, st, _, _ = loop
        return (i < stop) & ~jnp.all(st.done)

    def inner(index, width):
        def cond(loop):
            pending = loop[2].pending
            return running(loop) & (_bucket_index(pending.k_row, drafter.num_tokens) == index)

        def body(loop):
            i, st, sc, rec = loop
            st, sc, rec = speculative_round(params, draft_params, st, sc, rec, cfg, drafter,
                                            ext, width)
            return i + 1, st, sc, rec
        return cond, body

    loops = [inner(index, width) for index, width in enumerate(draft_buckets(drafter.num_tokens))]

    def outer(loop):
        for cond, body in loops:
            loop = jax.lax.while_loop(cond, body, loop)
        return loop

    return jax.lax.while_loop(running, outer, (jnp.asarray(start, jnp.int32), state, carry, record))


def speculative_loop(params, state: DecodeState, cfg: GenerationConfig, drafter,
                     draft_params=None, start_tokens=None, ext: Extensions = NO_EXTENSIONS):
    """Prefill + `lax.while_loop` of speculative rounds until every row is done.

    drafter: `DraftModelDrafter` or `PromptLookupDrafter` (static). start_tokens: optional
    int32 [B] (or scalar) starting draft length per row (default cfg.num_assistant_tokens,
    clipped to [1, K]). Returns (final state with `spec` set, StepRecord, SpeculativeStats).
    """
    state, carry, record = speculative_start(params, state, cfg, drafter, draft_params,
                                             start_tokens, ext)
    _, state, carry, record = speculative_rounds(params, state, carry, record, cfg, drafter,
                                                 draft_params, ext)
    return state.replace(spec=carry), record, carry.stats
