"""Beam search and beam multinomial sampling, step for step Hugging Face's `_beam_search`.

Shapes: B prompt rows, K = num_beams, W = max(2, 1 + #EOS) * K candidates per step,
V vocabulary, T token buffer, N = T - prompt_bucket generated-token slots.

Per step (HF transformers 5.x, `GenerationMixin._beam_search`):

1. scores = processors(log_softmax(logits))              [B*K, V]; the processor context
   holds each beam's *own* running sequence;
2. acc = scores + running_score                          [B, K*V];
3. W candidates: top-W of acc (search) or W draws without replacement from softmax(acc),
   re-sorted by acc (sampling; Gumbel-top-W has exactly that distribution);
4. a candidate "hits" when its token is an EOS id or the row's budget is used up;
5. running beams := the best K candidates that did not hit (hitters get -1e9);
6. finished set := best K of (finished set, the hitters among the top K candidates scored
   acc / new_len ** length_penalty); blocked when the row cannot improve any more;
7. the KV cache rows are gathered by the running beams' source beam (`gather_rows`);
8. a row stops when it cannot improve (HF's early-stopping heuristic, in the three
   `early_stopping` forms), when early_stopping=True and K hypotheses are finished, or when
   every candidate hit. A stopped row is frozen; the loop runs while any row is live.

Rows are right-padded with their own prompt length (HF left-pads); every row generates in
lock-step, so "new tokens so far" is the same for all rows and the length penalty and the
early-stopping heuristic match HF's batched left-padded run and HF run on each row alone.

Example:
    >>> import jax, jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = GenerationConfig(num_beams=4, num_return_sequences=2, max_new_tokens=5,
    ...                        early_stopping=True)
    >>> out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2], [3]], cfg), cfg)
    >>> out.sequences.shape[0], out.sequences_scores.shape     # 2 prompts x 2 returned
    (4, (4,))
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen import stopping
from jaxgen.cache import Cache
from jaxgen.cache.layer_forms import holds_layer_tuples, to_layer_tuples
from jaxgen.config.generation import GenerationConfig
from jaxgen.constraints.automaton import advance, mask_scores
from jaxgen.core.extensions import NO_EXTENSIONS, Extensions
from jaxgen.core.output import GenerateOutput
from jaxgen.core.state import DecodeState, init_cache_for
from jaxgen.core.step import (
    forward_last,
    invalid_logits,
    prefill,
    processor_context,
    reason_of,
    stop_flags,
)
from jaxgen.logits.chain import process_logits
from jaxgen.logits.sampling import step_keys

NEG = -1.0e9  # HF's "impossible" score offset (kept identical: it shapes fp32 rounding)


# ------------------------------------------------------------------------- cache rows
def cache_batch_axes(model, cfg: GenerationConfig, buffer_len: int, bucket: int,
                     layer_tuples: bool = False) -> tuple:
    """For each cache leaf (in `jax.tree_util.tree_leaves` order), the axis that indexes batch
    rows, or None for leaves without one. layer_tuples: the cache's per-layer fields are held
    as one buffer per layer (jaxgen.cache.layer_forms, as a backend may carry them).

    Found by comparing the shapes of the cache `init_state` builds for two batch sizes (no
    allocation), so every cache kind honouring the model contract works (dense, int8, ring).
    """
    def shapes(batch):
        def build():
            cache = init_cache_for(model, cfg, batch, buffer_len, bucket)
            return to_layer_tuples(cache) if layer_tuples else cache
        return jax.tree_util.tree_leaves(jax.eval_shape(build))

    two, three = shapes(2), shapes(3)

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        return diff[0] if diff else None

    return tuple(axis(a, b) for a, b in zip(two, three))


def _map_rows(fn, cache, axes: tuple):
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    if len(leaves) != len(axes):
        raise ValueError("the cache does not have the structure model.init_cache returns")
    return jax.tree_util.tree_unflatten(
        treedef, [leaf if ax is None else fn(leaf, ax) for leaf, ax in zip(leaves, axes)])


def repeat_rows(cache, axes: tuple, times: int):
    """[.., B, ..] -> [.., B*times, ..]: row b becomes rows b*times .. b*times+times-1."""
    return _map_rows(lambda leaf, ax: jnp.repeat(leaf, times, axis=ax), cache, axes)


def gather_rows(cache, axes: tuple, rows: jax.Array):
    """Reorders cache rows: new row i = old row rows[i]. rows int32 [B*K] (an XLA gather)."""
    return _map_rows(lambda leaf, ax: jnp.take(leaf, rows, axis=ax), cache, axes)


# ------------------------------------------------------------------------- state
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BeamState:
    """Loop carry. "run_*": the K running beams; "fin_*": the K best finished hypotheses."""

    step: jax.Array  # int32 [] new tokens generated so far
    run_tokens: jax.Array  # int32 [B, K, T]
    run_scores: jax.Array  # float32 [B, K] accumulated processed log-probs
    run_indices: jax.Array  # int32 [B, K, N] HF beam_indices (b*K + source beam), -1 unset
    run_token_scores: jax.Array  # float32 [B, K, N] processed log-prob of each new token
    fin_tokens: jax.Array  # int32 [B, K, T]
    fin_scores: jax.Array  # float32 [B, K] length-penalised; sorted descending
    fin_indices: jax.Array  # int32 [B, K, N]
    fin_token_scores: jax.Array  # float32 [B, K, N]
    fin_len: jax.Array  # int32 [B, K] tokens in the hypothesis (prompt included)
    fin_reason: jax.Array  # int32 [B, K] jaxgen.stopping reason that finished it
    fin_done: jax.Array  # bool [B, K] HF is_sent_finished
    improvable: jax.Array  # bool [B] HF is_early_stop_heuristic_unsatisfied
    live: jax.Array  # bool [B] row still searching
    invalid: jax.Array  # bool [B] a running beam of the row got NaN / inf logits
    cache: Cache  # rows b*K + k
    scores: jax.Array | None  # float32 [B*K, N, V] processed scores per step (output_scores)
    logits: jax.Array | None  # float32 [B*K, N, V] raw logits per step (output_logits)
    constraint: jax.Array | None = None  # int32 [B, K] each running beam's automaton state

    def replace(self, **changes) -> "BeamState":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BeamResult:
    """The top `num_return_sequences` hypotheses per row, batch-major (R = num_return_sequences).

    sequences        int32 [B*R, T]   prompt + generated, right-padded with pad_token_id
    lengths          int32 [B*R]
    prompt_lengths   int32 [B*R]
    stop_reason      int32 [B*R]      EOS, STOP_STRING, CUSTOM or MAX_LENGTH
    sequences_scores float32 [B*R]    HF's sequences_scores (sum of log-probs / len ** lp)
    token_logprobs   float32 [B*R, N] processed log-prob of each generated token
    beam_indices     int32 [B*R, N]   HF's beam_indices (-1 past the end)
    scores, logits   float32 [B*K, N, V] or None (HF's per-step running-beam scores/logits)
    prompt_logprobs  float32 [B*R, P] or None (cfg.prompt_logprobs: each row's prompt's)
    """

    sequences: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    stop_reason: jax.Array
    sequences_scores: jax.Array
    token_logprobs: jax.Array
    beam_indices: jax.Array
    scores: jax.Array | None
    logits: jax.Array | None
    prompt_logprobs: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Per-call constants of the search (the arrays are traced, the ints are static)."""

    num_beams: int
    width: int  # W candidates per step
    vocab: int
    buffer_len: int
    steps: int
    early_stopping: Any
    do_sample: bool
    eos_ids: tuple
    prompt_len: jax.Array  # int32 [B]
    max_new: jax.Array  # int32 [B]
    length_penalty: jax.Array  # float32 [B]
    keys: jax.Array  # PRNG keys [B]
    cfg: GenerationConfig  # dynamic leaves expanded to B*K rows
    cache_axes: tuple  # cache_batch_axes(model, T)
    ext: Extensions  # user logits processors / stopping criteria
    stop_tables: Any  # jaxgen.stopping.strings tables or None
    automaton: Any = None  # jaxgen.constraints.automaton.TokenAutomaton or None


def num_candidates(cfg: GenerationConfig) -> int:
    """HF's beams_to_keep: max(2, 1 + #EOS) * num_beams."""
    return max(2, 1 + len(cfg.eos_ids)) * cfg.num_beams


def _context(static: _Static, tokens: jax.Array, length: jax.Array, copies: int):
    """ProcessorContext over [B*copies] rows (each beam / candidate sees its own sequence)."""
    rep = lambda a: jnp.repeat(a, copies, axis=0)  # noqa: E731
    return processor_context(tokens, rep(length), rep(static.prompt_len), rep(static.max_new))


def _candidate_stops(static: _Static, tokens: jax.Array, token: jax.Array,
                     lengths: jax.Array, scores: jax.Array, source: jax.Array) -> jax.Array:
    """HF's stopping criteria on the candidates, as jaxgen stop reasons (0 = running).

    tokens int32 [B, W, T] with the new token written; token int32 [B, W]; lengths [B] the
    index the new token went to; scores [B*K, V] processed; source [B, W] beam per candidate.
    The flags and their priority are jaxgen.core.step.stop_flags / reason_of, as in every loop.
    """
    batch, width, buffer_len = tokens.shape
    rep = lambda a: jnp.repeat(a, width)  # noqa: E731  [B] -> [B*W]
    cand_scores = None
    if static.ext.stopping_criteria:
        cand_scores = _take(scores.reshape(batch, static.num_beams, -1), source)  # [B, W, V]
        cand_scores = cand_scores.reshape(batch * width, -1)  # [B*W, V]
    flags = stop_flags(static.cfg, tokens=tokens.reshape(batch * width, buffer_len),
                       new_length=rep(lengths + 1), token=token.reshape(-1),
                       prompt_len=rep(static.prompt_len), max_new=rep(static.max_new),
                       buffer_len=buffer_len, stop_tables=static.stop_tables, ext=static.ext,
                       scores=cand_scores)
    return reason_of(flags).reshape(batch, width)  # [B, W]


def _take(array: jax.Array, index: jax.Array) -> jax.Array:
    """array [B, M, ...], index int [B, J] -> [B, J, ...] (HF's _gather_beams)."""
    index = index.reshape(index.shape + (1,) * (array.ndim - 2))
    return jnp.take_along_axis(array, index, axis=1)


def _set_column(array: jax.Array, column: jax.Array, values: jax.Array) -> jax.Array:
    """array [B, J, C]; column int32 [B] (or []); values [B, J] -> [b, :, column[b]] set."""
    hit = jnp.arange(array.shape[-1]) == jnp.reshape(column, (-1, 1, 1))  # [B|1, 1, C]
    return jnp.where(hit, values[:, :, None], array)


# ------------------------------------------------------------------------- one step
def _choose_candidates(static: _Static, acc: jax.Array, lengths: jax.Array):
    """acc float32 [B, K*V] -> (candidate scores [B, W] descending, flat indices [B, W])."""
    width = static.width
    if not static.do_sample:
        return jax.lax.top_k(acc, width)
    keys = step_keys(static.keys, lengths)  # [B]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, acc.shape[1:], jnp.float32))(keys)
    _, index = jax.lax.top_k(acc + gumbel, width)  # [B, W] a draw without replacement
    picked = jnp.take_along_axis(acc, index, axis=1)  # [B, W]
    picked, order = jax.lax.top_k(picked, width)  # HF re-sorts the draws by score
    return picked, jnp.take_along_axis(index, order, axis=1)


def beam_step(static: _Static, bs: BeamState, raw_logits: jax.Array) -> BeamState:
    """Consumes the running beams' next-token logits [B*K, V]; returns the updated carry."""
    batch, beams, buffer_len = bs.run_tokens.shape
    vocab, width = static.vocab, static.width
    step = bs.step
    lengths = static.prompt_len + step  # [B] index the new token goes to
    ctx = _context(static, bs.run_tokens.reshape(batch * beams, buffer_len), lengths, beams)
    raw_logits = raw_logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(raw_logits, axis=-1)  # [B*K, V]
    if static.automaton is not None:  # HF's prefix constraint: -inf outside, no renormalising
        logprobs = mask_scores(static.automaton, bs.constraint.reshape(-1), logprobs,
                               static.eos_ids)
    scores = process_logits(static.cfg, logprobs, ctx,
                            extra=static.ext.logits_processor)  # [B*K, V] (HF: on log-probs)
    acc = (scores.reshape(batch, beams, vocab)
           + bs.run_scores[:, :, None]).reshape(batch, beams * vocab)  # [B, K*V]

    # c. top-W continuations over all beams
    cand_scores, flat = _choose_candidates(static, acc, lengths)  # [B, W]
    source = flat // vocab  # [B, W] beam within the row
    token = (flat % vocab).astype(jnp.int32)  # [B, W]
    cand_tokens = _set_column(_take(bs.run_tokens, source), lengths, token)  # [B, W, T]
    hf_index = source + (jnp.arange(batch) * beams)[:, None]  # [B, W]
    cand_indices = _set_column(_take(bs.run_indices, source), step, hf_index)  # [B, W, N]
    token_score = jnp.take_along_axis(scores.reshape(batch, beams * vocab), flat, axis=1)
    cand_token_scores = _set_column(_take(bs.run_token_scores, source), step,
                                    token_score)  # [B, W, N]

    # d. which candidates hit a stopping criterion (EOS, stop strings, user criteria, budget)
    cand_reason = _candidate_stops(static, cand_tokens, token, lengths, scores, source)
    hits = cand_reason != stopping.NOT_STOPPED  # [B, W]

    # e. the next running beams: best K candidates that did not hit
    run_lp = cand_scores + hits.astype(jnp.float32) * NEG  # [B, W]
    _, keep = jax.lax.top_k(run_lp, beams)  # [B, K]
    run_scores = _take(run_lp, keep)  # [B, K]
    run_source = _take(source, keep)  # [B, K]
    run_constraint = bs.constraint
    if static.automaton is not None:  # each kept beam's state, moved along its new token
        moved = advance(static.automaton, _take(bs.constraint, source).reshape(-1),
                        token.reshape(-1)).reshape(batch, width)  # [B, W]
        run_constraint = _take(moved, keep)  # [B, K]

    # f. merge the newly finished top-K candidates into the finished set
    lp = static.length_penalty  # [B]
    just_finished = hits & (jnp.arange(width) < beams)[None, :]  # [B, W]
    fin_lp = cand_scores / ((step + 1).astype(jnp.float32) ** lp)[:, None]  # [B, W]
    if static.early_stopping is True:
        all_done = jnp.all(bs.fin_done, axis=1, keepdims=True)  # [B, 1]
        fin_lp = fin_lp + all_done.astype(jnp.float32) * NEG
    fin_lp = fin_lp + (~bs.improvable).astype(jnp.float32)[:, None] * NEG
    fin_lp = fin_lp + (~just_finished).astype(jnp.float32) * NEG
    merged_scores = jnp.concatenate([bs.fin_scores, fin_lp], axis=1)  # [B, K+W]
    _, best = jax.lax.top_k(merged_scores, beams)  # [B, K]
    pick = lambda old, new: _take(jnp.concatenate([old, new], axis=1), best)  # noqa: E731
    new_len = jnp.broadcast_to((lengths + 1)[:, None], (batch, width))  # [B, W]
    frozen = ~bs.live  # [B]
    keep_old = lambda old, new: jnp.where(  # noqa: E731
        frozen.reshape((batch,) + (1,) * (old.ndim - 1)), old, new)
    fin_scores = keep_old(bs.fin_scores, _take(merged_scores, best))
    fin_done = keep_old(bs.fin_done, pick(bs.fin_done, just_finished))
    fin = dict(
        fin_tokens=keep_old(bs.fin_tokens, pick(bs.fin_tokens, cand_tokens)),
        fin_indices=keep_old(bs.fin_indices, pick(bs.fin_indices, cand_indices)),
        fin_token_scores=keep_old(bs.fin_token_scores,
                                  pick(bs.fin_token_scores, cand_token_scores)),
        fin_len=keep_old(bs.fin_len, pick(bs.fin_len, new_len)),
        fin_reason=keep_old(bs.fin_reason, pick(bs.fin_reason, cand_reason)),
    )

    # g. the early-stopping heuristic and the per-row stop
    new_count = (step + 1).astype(jnp.float32)
    if static.early_stopping == "never":
        hypothetical = jnp.where(lp > 0.0, static.max_new.astype(jnp.float32), new_count)  # [B]
    else:
        hypothetical = jnp.broadcast_to(new_count, lp.shape)  # [B]
    best_running = run_scores[:, 0] / hypothetical ** lp  # [B]
    worst_finished = jnp.where(fin_done, jnp.min(fin_scores, axis=1, keepdims=True), NEG)
    improvable = bs.improvable & jnp.any(best_running[:, None] > worst_finished, axis=1)
    open_beam = ~(jnp.all(fin_done, axis=1) & (static.early_stopping is True))  # [B]
    continuable = ~jnp.all(hits, axis=1)  # [B]
    invalid = bs.invalid  # [B]
    if not static.cfg.remove_invalid_values:  # HF cleans the scores then and goes on
        invalid = invalid | (bs.live & jnp.any(invalid_logits(raw_logits).reshape(batch, beams),
                                               axis=1))
    live = bs.live & improvable & open_beam & continuable & ~invalid  # [B]

    # the running beams' sequences, and their cache rows gathered by source beam
    flat_source = (run_source + (jnp.arange(batch) * beams)[:, None]).reshape(-1)  # [B*K]
    record = lambda buf, value: None if buf is None else buf.at[:, step].set(value)  # noqa: E731
    return bs.replace(
        step=step + 1,
        run_tokens=_take(cand_tokens, keep),
        run_scores=run_scores,
        run_indices=_take(cand_indices, keep),
        run_token_scores=_take(cand_token_scores, keep),
        fin_scores=fin_scores,
        fin_done=fin_done,
        improvable=improvable,
        live=live,
        invalid=invalid,
        cache=gather_rows(bs.cache, static.cache_axes, flat_source),
        scores=record(bs.scores, scores),
        logits=record(bs.logits, raw_logits),
        constraint=run_constraint,
        **fin,
    )


# ------------------------------------------------------------------------- the loop
def init_beams(state: DecodeState, cfg: GenerationConfig, cache) -> BeamState:
    batch, buffer_len = state.tokens.shape
    beams = cfg.num_beams
    steps = max(buffer_len - state.prompt_bucket, 1)
    vocab = state.model.vocab_size
    tokens = jnp.repeat(state.tokens[:, None, :], beams, axis=1)  # [B, K, T]
    first = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32),
                             jnp.full((batch, beams - 1), NEG, jnp.float32)], axis=1)  # [B, K]
    per_step = lambda on: (jnp.zeros((batch * beams, steps, vocab), jnp.float32)  # noqa: E731
                           if on else None)
    return BeamState(
        step=jnp.int32(0),
        run_tokens=tokens,
        run_scores=first,
        run_indices=jnp.full((batch, beams, steps), -1, jnp.int32),
        run_token_scores=jnp.zeros((batch, beams, steps), jnp.float32),
        fin_tokens=tokens,
        fin_scores=jnp.full((batch, beams), NEG, jnp.float32),
        fin_indices=jnp.full((batch, beams, steps), -1, jnp.int32),
        fin_token_scores=jnp.zeros((batch, beams, steps), jnp.float32),
        fin_len=jnp.broadcast_to(state.prompt_len[:, None], (batch, beams)).astype(jnp.int32),
        fin_reason=jnp.zeros((batch, beams), jnp.int32),
        fin_done=jnp.zeros((batch, beams), bool),
        improvable=jnp.ones((batch,), bool),
        live=jnp.ones((batch,), bool),
        invalid=jnp.zeros((batch,), bool),
        cache=cache,
        scores=per_step(cfg.output_scores),
        logits=per_step(cfg.output_logits),
        constraint=None if state.constraint is None else jnp.repeat(
            state.constraint.state[:, None], beams, axis=1),  # [B, K]
    )


def beam_search(params, state: DecodeState, cfg: GenerationConfig,
                ext: Extensions = NO_EXTENSIONS) -> BeamResult:
    """Prefill once per prompt row, then `lax.while_loop` over beam steps. Traced under jit.

    ext: user logits processors (run on every beam's log-probs) and stopping criteria (run on
    every candidate, as HF's StoppingCriteriaList is); stop strings come from state.stop_tables.
    """
    model = state.model
    batch, buffer_len = state.tokens.shape
    beams = cfg.num_beams
    returns = cfg.num_return_sequences
    if returns > beams:
        raise ValueError(f"`num_return_sequences` ({returns}) has to be <= `num_beams` ({beams})")
    axes = cache_batch_axes(model, cfg, buffer_len, state.prompt_bucket,
                            layer_tuples=holds_layer_tuples(state.cache))
    lp = jnp.broadcast_to(jnp.asarray(cfg.length_penalty, jnp.float32).reshape(-1), (batch,))
    static = _Static(
        num_beams=beams, width=num_candidates(cfg), vocab=model.vocab_size,
        buffer_len=buffer_len, steps=max(buffer_len - state.prompt_bucket, 1),
        early_stopping=cfg.early_stopping, do_sample=bool(cfg.do_sample), eos_ids=cfg.eos_ids,
        prompt_len=state.prompt_len, max_new=state.max_new, length_penalty=lp,
        keys=state.key, cfg=cfg.repeat_rows(batch, beams), cache_axes=axes, ext=ext,
        stop_tables=getattr(state, "stop_tables", None),
        automaton=None if state.constraint is None else state.constraint.automaton)
    # The prompt runs once per row; its cache is then repeated to the K beams of the row.
    state, logits, *prompt_lp = prefill(params, state, cfg.prefill_chunk_size,
                                        prompt_logprobs=bool(cfg.prompt_logprobs))  # [B, V]
    bs = init_beams(state, cfg, repeat_rows(state.cache, axes, beams))
    bs = beam_step(static, bs, jnp.repeat(logits, beams, axis=0))

    def cond(carry: BeamState):
        return (carry.step < static.steps) & jnp.any(carry.live)

    def body(carry: BeamState):
        length = jnp.repeat(static.prompt_len + carry.step, beams)  # [B*K] tokens per beam
        tokens = carry.run_tokens.reshape(batch * beams, buffer_len)  # [B*K, T]
        logits, cache = forward_last(model, params, tokens, length, carry.cache)
        return beam_step(static, carry.replace(cache=cache), logits)

    bs = jax.lax.while_loop(cond, body, bs)
    result = _result(bs, static, returns, state.pad_token_id)
    if prompt_lp:  # [B, P] -> the R returned rows of every prompt
        result = dataclasses.replace(result, prompt_logprobs=jnp.repeat(prompt_lp[0], returns,
                                                                        axis=0))
    return result


def _result(bs: BeamState, static: _Static, returns: int, pad_id: int) -> BeamResult:
    batch, beams, buffer_len = bs.fin_tokens.shape
    flat = lambda a: a[:, :returns].reshape((batch * returns,) + a.shape[2:])  # noqa: E731
    sequences = flat(bs.fin_tokens)  # [B*R, T]
    lengths = flat(bs.fin_len)  # [B*R]
    prompt_lengths = jnp.repeat(static.prompt_len, returns)  # [B*R]
    reason = flat(bs.fin_reason)  # [B*R]
    reason = jnp.where(reason == stopping.NOT_STOPPED, stopping.MAX_LENGTH, reason)
    reason = jnp.where(jnp.repeat(bs.invalid, returns), stopping.INVALID_LOGITS, reason)
    del pad_id  # unwritten positions already hold the pad id from the prompt buffer
    return BeamResult(
        sequences=sequences, lengths=lengths, prompt_lengths=prompt_lengths,
        stop_reason=reason, sequences_scores=flat(bs.fin_scores),
        token_logprobs=flat(bs.fin_token_scores), beam_indices=flat(bs.fin_indices),
        scores=bs.scores, logits=bs.logits)


@dataclasses.dataclass(frozen=True)
class BeamLoop:
    """Beam search / beam sampling as a loop the plan runs in one call (static). Beam
    modes have no chunked form (HF streams only greedy and sampling)."""

    ext: Extensions = NO_EXTENSIONS
    return_beam_indices: bool = False
    chunkable = False
    takes_layer_tuples = True  # runs a cache held as per-layer buffers (cache.layer_forms)

    def decode_rows(self, state: DecodeState, cfg: GenerationConfig) -> int | None:
        """Rows each decode forward runs: batch x beams."""
        return state.batch * int(cfg.num_beams)

    def run(self, params, state: DecodeState, cfg: GenerationConfig, inputs=None):
        beams = beam_search(params, state, cfg, self.ext)
        return GenerateOutput(sequences=beams.sequences, lengths=beams.lengths,
                              prompt_lengths=beams.prompt_lengths, stop_reason=beams.stop_reason,
                              token_logprobs=beams.token_logprobs, scores=beams.scores,
                              logits=beams.logits, sequences_scores=beams.sequences_scores,
                              beam_indices=beams.beam_indices if self.return_beam_indices
                              else None, prompt_logprobs=beams.prompt_logprobs)


__all__ = ["BeamLoop", "BeamResult", "BeamState", "beam_search", "beam_step", "cache_batch_axes",
           "gather_rows", "repeat_rows", "num_candidates"]
