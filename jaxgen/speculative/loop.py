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
SmolLM2 at batch 8 here). The width never cuts a row's drafts when sampling, so a sampled
row's output does not depend on the other rows of the batch (the greedy fallback below may
cut them, which never changes greedy tokens).

Plain steps (`assistant_fallback`, on by default; jaxgen.speculative.fallback). Before the
drafts are proposed, a row whose running acceptance estimate says drafting does not pay is
asked for no drafts (a row that stopped probes again now and then); after they are proposed,
a greedy batch cuts every row's drafts to the width that minimises its projected time to
finish, 0 meaning a plain one-token step (the one-position bucket). Only drafts change, so
greedy tokens are plain greedy's and sampling stays exact; the carry holds the estimates
(dynamic state: no new program).

Sampling keys: the round key of row b is fold_in(row_key[b], L) (a row's L is different every
round), split by tag into draft draws (0), acceptance uniforms (1) and the fix draw (2): a row's
output never depends on which other rows share the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxgen.config.generation import GenerationConfig
from jaxgen.constraints.automaton import advance, advance_path, mask_path
from jaxgen.core.contracts import Drafter, DraftRequest, DraftState, Proposal
from jaxgen.core.extensions import NO_EXTENSIONS, Extensions
from jaxgen.core.output import GenerateOutput, StepRecord
from jaxgen.core.speculative_stats import SpeculativeStats
from jaxgen.core.state import DecodeState
from jaxgen.core.step import mark_done, stop_flags
from jaxgen.loops.decode import choose_and_write, prefill_with_record
from jaxgen.speculative import verify
from jaxgen.speculative.fallback import FallbackState, choose_width, gate_rows
from jaxgen.speculative.positions import process_positions

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AssistInputs:
    """The dynamic inputs of an assisted call (PyTree leaves of the jit).

    draft_params   the assistant model's params, or None (drafters without weights)
    start_tokens   int32 [B] (or []) starting draft length per row, or None
                   (cfg.num_assistant_tokens)
    """

    draft_params: Any = None
    start_tokens: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecCarry:
    """Per-mode state of the assisted loop (kept in `DecodeState.spec` of the final state)."""

    draft_state: DraftState  # the drafter's own state (a draft KV cache), or None
    k_sched: jax.Array  # int32 [B] the schedule's current draft length per row
    stats: SpeculativeStats
    pending: Optional[Proposal]  # the drafts the next round verifies (k_row already capped)
    hidden: Optional[jax.Array] = None  # [B, D] target hidden state at each row's newest
    #                                     verified position (drafters that read "hidden")
    fallback: Optional[FallbackState] = None  # per-row acceptance estimates and probe
    #                                           countdowns (assistant_fallback), or None


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
                    ext: Extensions, drafter: Drafter, draft_state, path=None):
    """Target forward over [last token, drafts] (drafts [B, k], k static) and the processed
    scores at every position; a drafter that already ran part of it (`verify`, shared
    compute) finishes it instead. path: int32 [B, k+1] the constraint automaton's state at
    each position (state.constraint), which masks the raw logits before the processors.
    Returns (p_scores [B, k+1, V], raw [B, k+1, V], hidden [B, k+1, D], cache)."""
    last = state.length - 1  # [B]
    last_token = jnp.take_along_axis(state.tokens, last[:, None], axis=1)  # [B, 1]
    tokens = jnp.concatenate([last_token, drafts], axis=1)  # [B, k+1]
    positions = last[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [B, k+1]
    finish = getattr(drafter, "verify", None)
    if finish is not None:
        out = finish(params, draft_state, state, tokens, positions)
    else:
        out = state.model(params, tokens, positions, state.cache)
    raw = out.logits.astype(jnp.float32)  # [B, k+1, V]
    allowed = mask_path(state.constraint, raw, path, cfg.eos_ids)  # [B, k+1, V]
    scores = process_positions(cfg, allowed, work, state.length, state, ext.logits_processor)
    return scores, raw, out.hidden, out.cache


def _position_flags(cfg, state: DecodeState, tokens: jax.Array, out: jax.Array,
                    scores: jax.Array, raw: jax.Array, ext: Extensions):
    """jaxgen.core.step.stop_flags at every emitted position j (token out[:, j] at index L + j),
    with the tokens up to and including j: StopFlags of bool [B, k+1]."""
    width = out.shape[1]
    new_length = state.length[:, None] + 1 + jnp.arange(width)[None, :]  # [B, k+1]

    def at(length, token, score, logits):  # one position: [B], [B], [B, V], [B, V]
        return stop_flags(cfg, tokens=tokens, new_length=length, token=token,
                          prompt_len=state.prompt_len, max_new=state.max_new,
                          buffer_len=state.buffer_len, stop_tables=state.stop_tables, ext=ext,
                          scores=score, raw_logits=logits)

    return jax.vmap(at, in_axes=(1, 1, 1, 1), out_axes=1)(new_length, out, scores, raw)


class Emitted(NamedTuple):
    """What `emit_accepted` leaves: the state's new fields and the record."""

    tokens: jax.Array  # int32 [B, T]
    length: jax.Array  # int32 [B]
    emitted: jax.Array  # int32 [B] m: tokens emitted this round (0 for done rows)
    newest: jax.Array  # int32 [B, 1] the last emitted position
    done: jax.Array  # bool [B]
    reason: jax.Array  # int32 [B]
    constraint: Any  # the constraint state after the last emitted token, or None
    record: StepRecord


def emit_accepted(state: DecodeState, record: StepRecord, cfg, ext: Extensions, out: jax.Array,
                  n: jax.Array, p_scores: jax.Array, raw: jax.Array, path=None) -> Emitted:
    """Writes a round's accepted tokens out [B, k+1] (n [B] accepted drafts, then the fix)
    with their processed / raw scores [B, k+1, V], stopping after the first position where a
    stop condition fires (so no token follows a stop). path: the constraint automaton's state
    at each position [B, k+1], or None."""
    k = out.shape[1] - 1
    batch, buffer = state.tokens.shape
    live = ~state.done  # [B]
    length = state.length  # [B]
    constraint = state.constraint
    # Emit out[:, :n+1] but stop after the first position where a stop condition fires.
    rows = jnp.arange(batch)[:, None]
    index = length[:, None] + jnp.arange(k + 1)[None, :]  # [B, k+1]
    candidate = jnp.arange(k + 1)[None, :] <= n[:, None]  # [B, k+1]
    written = state.tokens.at[rows, jnp.where(candidate & live[:, None], index, buffer)].set(
        out, mode="drop")  # [B, T]
    flags = _position_flags(cfg, state, written, out, p_scores, raw, ext)  # [B, k+1] each
    fires = flags.any() & candidate  # [B, k+1]
    first = jnp.where(jnp.any(fires, 1), jnp.argmax(fires, 1), k + 1)  # [B]
    emitted = jnp.where(live, jnp.minimum(n, first) + 1, 0).astype(jnp.int32)  # [B] m
    emit = jnp.arange(k + 1)[None, :] < emitted[:, None]  # [B, k+1]
    tokens = state.tokens.at[rows, jnp.where(emit, index, buffer)].set(out, mode="drop")
    new_length = length + emitted  # [B]
    newest = jnp.maximum(emitted - 1, 0)[:, None]  # [B, 1] the last emitted position
    at_last = lambda a: jnp.take_along_axis(a, newest, axis=1)[:, 0]  # noqa: E731  [B]
    done, reason = mark_done(state.done, state.stop_reason, flags.map(at_last), live)
    if constraint is not None:  # the state before the last emitted token (out[:n] = drafts)
        moved = advance(constraint.automaton, at_last(path), at_last(out))  # [B]
        constraint = constraint.replace(state=jnp.where(live, moved, constraint.state))
    step = length[:, None] - state.prompt_len[:, None] + jnp.arange(k + 1)[None, :]  # [B, k+1]
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(p_scores, axis=-1), out[..., None],
                                   axis=-1)[..., 0]  # [B, k+1]
    record = record.write_rows(jnp.where(emit, step, record.token_logprobs.shape[1]),
                               logprobs, p_scores, raw)

    return Emitted(tokens, new_length, emitted, newest, done, reason, constraint, record)


def _round_keys(state: DecodeState):
    """Per-row round keys fold_in(row_key, L), split by tag: draft draws (0), acceptance
    uniforms (1), the fix draw (2). Returns tag -> keys [B]."""
    round_keys = jax.vmap(jax.random.fold_in)(state.key, state.length)  # [B]
    return lambda t: jax.vmap(lambda k: jax.random.fold_in(k, t))(round_keys)


def propose_next(params, inputs: AssistInputs, state: DecodeState, carry: SpecCarry,
                 cfg: GenerationConfig, drafter: Drafter, ext: Extensions = NO_EXTENSIONS,
                 verified=None) -> tuple[DecodeState, SpecCarry]:
    """Drafts for the round that starts from `state`; stored as `carry.pending`. A drafter
    that writes the target's cache returns it: the state carries it on. verified: (hidden
    states [B, W, D], position of entry 0 [B]) of the forward that just ran, handed to a
    drafter that reads "hidden_states"."""
    K = drafter.num_tokens
    width = state.tokens.shape[1]
    live = ~state.done  # [B]
    limit = jnp.minimum(state.prompt_len + state.max_new, width)  # [B] row's max length
    k_cap = jnp.clip(limit - state.length - 1, 0, K)  # [B] so n + 1 never passes the budget
    k_want = jnp.where(live, jnp.minimum(carry.k_sched, k_cap), 0)  # [B]
    fallback, asked = carry.fallback, k_want
    if fallback is not None:  # rows whose drafts do not pay skip drafting (fallback.py)
        k_want, _, fallback = gate_rows(fallback, k_want, live, draft_buckets(K), cfg)
    threshold = cfg.assistant_confidence_threshold  # None or <= 0: off (HF)
    request = DraftRequest(
        state=state, k_want=k_want, keys=_round_keys(state)(0), cfg=cfg, ext=ext,
        do_sample=cfg.do_sample, keep_q=cfg.do_sample or cfg.assistant_ensemble_weight
        is not None, threshold=threshold,
        target_params=params if "params" in drafter.reads else None,
        hidden=carry.hidden if "hidden" in drafter.reads else None)
    if "hidden_states" in drafter.reads:
        hidden_states, hidden_start = verified
        request = dataclasses.replace(request, hidden_states=hidden_states,
                                      hidden_start=hidden_start)
    proposal, draft_state, cache = drafter.propose(inputs.draft_params, carry.draft_state,
                                                   request)
    k_row = jnp.where(live, jnp.minimum(proposal.k_row, k_want), 0)  # [B]
    stats = carry.stats
    if fallback is not None:
        if not cfg.do_sample:  # the batch's verify width (0: a plain one-token step)
            k_row = choose_width(fallback, k_row, limit - state.length, live,
                                 draft_buckets(K), cfg)
        held = live & (asked > 0) & (k_row == 0) & ((k_want == 0) | (proposal.k_row > 0))
        stats = dataclasses.replace(stats, plain_steps=stats.plain_steps
                                    + held.astype(jnp.int32))  # [B]
    proposal = dataclasses.replace(proposal, k_row=k_row)
    return state.replace(cache=cache), dataclasses.replace(carry, draft_state=draft_state,
                                                           pending=proposal, stats=stats,
                                                           fallback=fallback)


def speculative_round(params, inputs: AssistInputs, state: DecodeState, carry: SpecCarry,
                      record: StepRecord, cfg: GenerationConfig, drafter: Drafter,
                      ext: Extensions = NO_EXTENSIONS, width: int | None = None):
    """Verifies `carry.pending` (every row's k_row <= width, static; default K), accepts,
    emits, rolls back, then proposes the next round's drafts. Returns (state, carry, record)."""
    K = drafter.num_tokens
    k = K if width is None else int(width)
    live = ~state.done  # [B]
    length = state.length  # [B]
    tag = _round_keys(state)
    weight = cfg.assistant_ensemble_weight
    proposal = carry.pending
    k_row = proposal.k_row  # [B] <= k
    drafts = proposal.drafts[:, :k]  # [B, k]
    q_scores = None if proposal.q_scores is None else proposal.q_scores[:, :k]  # [B, k, V]

    constraint = state.constraint  # drafts that leave the automaton get p = 0: rejected
    path = None if constraint is None else advance_path(constraint.automaton, constraint.state,
                                                        drafts)  # [B, k+1]
    p_scores, raw, hidden, cache = _verify_forward(params, state, proposal.tokens, drafts, cfg,
                                                   ext, drafter, carry.draft_state, path)
    if cfg.do_sample:
        uniforms = jax.vmap(lambda key: jax.random.uniform(key, (K,)))(tag(1))[:, :k]  # [B, k]
        n, fix = verify.accept_sample(drafts, k_row, p_scores, q_scores, uniforms, tag(2),
                                      weight)
    else:
        n, fix = verify.accept_greedy(drafts, k_row, p_scores, q_scores, weight)
    out = verify.assemble(drafts, n, fix, state.pad)  # [B, k+1]

    emitted_round = emit_accepted(state, record, cfg, ext, out, n, p_scores, raw, path)
    tokens, new_length, emitted, newest, done, reason, constraint, record = emitted_round

    # Roll both caches back by length.
    cache = cache.rollback(jnp.where(live, cache.length - (new_length - 1), 0))
    draft_state = drafter.rollback(carry.draft_state, new_length)
    new_hidden = carry.hidden
    if carry.hidden is not None:  # the hidden state that predicted each row's newest token
        picked = jnp.take_along_axis(hidden, newest[:, :, None], axis=1)[:, 0]  # [B, D]
        new_hidden = jnp.where(live[:, None], picked.astype(carry.hidden.dtype), carry.hidden)

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
                          cache=cache, constraint=constraint)
    fallback = carry.fallback
    if fallback is not None:
        fallback = fallback.observe(k_row, accepted)
    carry = dataclasses.replace(carry, draft_state=draft_state, k_sched=k_sched, stats=stats,
                                hidden=new_hidden, fallback=fallback)
    verified = (hidden, length - 1) if "hidden_states" in drafter.reads else None
    state, carry = propose_next(params, inputs, state, carry, cfg, drafter, ext, verified)
    return state, carry, record


def speculative_start(params, state: DecodeState, cfg: GenerationConfig, drafter: Drafter,
                      inputs: AssistInputs, ext: Extensions = NO_EXTENSIONS):
    """Prefill, the first token and the drafter's initial state.

    Returns (state, SpecCarry, StepRecord): the carry that `speculative_rounds` advances.
    """
    K = drafter.num_tokens
    batch = state.batch
    reads_hidden = "hidden" in drafter.reads
    reads_all = "hidden_states" in drafter.reads  # every prompt position's (MTP layers)
    state, record, logits, *hidden = prefill_with_record(params, state, cfg,
                                                         reads_hidden or reads_all, reads_all)
    verified = (hidden[0], jnp.zeros((batch,), jnp.int32)) if reads_all else None  # [B, P, D]
    hidden = hidden[0] if reads_hidden else None  # [B, D] the prompt's last hidden state
    state, record = choose_and_write(cfg, state, logits, record, 0, ext)
    draft_state = drafter.init(inputs.draft_params, state,
                               target_params=params if "params" in drafter.reads else None)
    start_tokens = inputs.start_tokens
    if not drafter.scheduled:  # prompt lookup: always up to K drafts
        start = jnp.full((batch,), K, jnp.int32)
    elif start_tokens is None:
        start = jnp.full((batch,), min(int(cfg.num_assistant_tokens), K), jnp.int32)
    else:
        start = jnp.broadcast_to(jnp.clip(jnp.asarray(start_tokens, jnp.int32), 1, K), (batch,))
    stats = SpeculativeStats.zeros(batch, K, start)
    if draft_state is not None:
        stats = dataclasses.replace(stats, draft_forwards=jnp.int32(1))
    fallback = None
    if cfg.assistant_fallback and getattr(drafter, "fallback", True):
        fallback = FallbackState.start(batch, cfg.assistant_probe_interval)
    carry = SpecCarry(draft_state=draft_state, k_sched=start, stats=stats, pending=None,
                      hidden=hidden, fallback=fallback)
    state, carry = propose_next(params, inputs, state, carry, cfg, drafter, ext, verified)
    return state, carry, record


def speculative_rounds(params, inputs: AssistInputs, state: DecodeState, carry: SpecCarry,
                       record: StepRecord, cfg: GenerationConfig, drafter: Drafter,
                       ext: Extensions = NO_EXTENSIONS, *, start=1, stop=None):
    """Runs rounds start..stop-1 (fewer once every row is done). Returns (next round index,
    state, SpecCarry, StepRecord).

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
            st, sc, rec = speculative_round(params, inputs, st, sc, rec, cfg, drafter, ext,
                                            width)
            return i + 1, st, sc, rec
        return cond, body

    loops = [inner(index, width) for index, width in enumerate(draft_buckets(drafter.num_tokens))]

    def outer(loop):
        for cond, body in loops:
            loop = jax.lax.while_loop(cond, body, loop)
        return loop

    return jax.lax.while_loop(running, outer, (jnp.asarray(start, jnp.int32), state, carry, record))


@dataclasses.dataclass(frozen=True)
class SpeculativeLoop:
    """Assisted decoding as a loop the plan can run in one call or in chunks (static).

    A step of this loop is one round (each round emits 1..K+1 tokens per row); its carry is
    (SpecCarry, StepRecord) and its dynamic inputs an AssistInputs.
    """

    drafter: Drafter
    ext: Extensions = NO_EXTENSIONS
    chunkable = True
    takes_layer_tuples = True  # runs a cache held as per-layer buffers (cache.layer_forms)

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """Rows of a plain step (verify forwards are wider)."""
        return state.batch

    def start(self, params, state: DecodeState, cfg: GenerationConfig, inputs: AssistInputs):
        state, carry, record = speculative_start(params, state, cfg, self.drafter, inputs,
                                                 self.ext)
        return state, (carry, record)

    def advance(self, params, state: DecodeState, extra, begin, end, cfg: GenerationConfig,
                inputs: AssistInputs):
        carry, record = extra
        _, state, carry, record = speculative_rounds(params, inputs, state, carry, record, cfg,
                                                     self.drafter, self.ext, start=begin,
                                                     stop=end)
        return state, (carry, record)

    def output(self, state: DecodeState, extra) -> GenerateOutput:
        carry, record = extra
        return GenerateOutput.from_state(state.replace(spec=carry), record, carry.stats)

    def run(self, params, state: DecodeState, cfg: GenerationConfig, inputs: AssistInputs):
        state, extra = self.start(params, state, cfg, inputs)
        state, extra = self.advance(params, state, extra, 1,
                                    state.buffer_len - state.prompt_bucket, cfg, inputs)
        return self.output(state, extra)
